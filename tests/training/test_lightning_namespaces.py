"""Both Lightning namespaces: ``pytorch_lightning`` (the default) and ``lightning.pytorch``.

The namespace is chosen once per process (ssl_lightning/_lightning.py), so the
``lightning.pytorch`` fit runs in a fresh interpreter that imports ``lightning`` first, as
``import lightning as L`` users do, and checks that ``pytorch_lightning`` is never imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning

import ssl_lightning
from ssl_lightning import _lightning
from ssl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]

_FIT = """
import json, sys
import lightning as L
import ssl_lightning
from ssl_lightning import BYOL, ImageFolderDataModule, KNNCallback, SmallConvNet

data = ImageFolderDataModule(train_dir=sys.argv[1] + "/train", val_dir=sys.argv[1] + "/test",
                             preset="cifar", batch_size=4, num_workers=0)
model = BYOL(SmallConvNet(widths=(8, 16)), projection_hidden_dim=32, projection_dim=16)
trainer = L.Trainer(max_epochs=1, limit_train_batches=2, accelerator="cpu", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, callbacks=[KNNCallback(3)])
trainer.fit(model, data)
print(json.dumps({
    "namespace": ssl_lightning.LIGHTNING_NAMESPACE,
    "step": trainer.global_step,
    "knn": float(trainer.callback_metrics["val/knn_top1"]),
    "pytorch_lightning_imported": sorted(m for m in sys.modules
                                         if m.split(".")[0] in ("pytorch_lightning",
                                                                "lightning_fabric")),
}))
"""


@pytest.mark.slow
def test_lightning_trainer_fits_a_method_with_knn_and_a_data_module(tiny_image_folder) -> None:
    pytest.importorskip("lightning")
    env = {k: v for k, v in os.environ.items() if k != _lightning.NAMESPACE_VARIABLE}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _FIT, str(tiny_image_folder)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["namespace"] == "lightning" and result["step"] == 2
    assert 0.0 <= result["knn"] <= 100.0
    assert result["pytorch_lightning_imported"] == []  # one namespace per process, never mixed


def test_default_namespace_is_pytorch_lightning() -> None:
    assert ssl_lightning.LIGHTNING_NAMESPACE == "pytorch_lightning"
    assert issubclass(ssl_lightning.BYOL, pytorch_lightning.LightningModule)
    assert issubclass(ssl_lightning.KNNCallback, pytorch_lightning.Callback)
    assert issubclass(ssl_lightning.ImageFolderDataModule, pytorch_lightning.LightningDataModule)


@pytest.mark.parametrize(("environ", "imported", "expected"), [
    ({}, frozenset(), "pytorch_lightning"),
    ({}, frozenset({"lightning"}), "lightning"),
    ({}, frozenset({"lightning", "pytorch_lightning"}), "pytorch_lightning"),
    ({"SSL_LIGHTNING_NAMESPACE": "lightning"}, frozenset(), "lightning"),
    ({"SSL_LIGHTNING_NAMESPACE": "lightning.pytorch"}, frozenset(), "lightning"),
    ({"SSL_LIGHTNING_NAMESPACE": "pytorch_lightning"}, frozenset({"lightning"}),
     "pytorch_lightning"),
])
def test_namespace_rules(environ: dict[str, str], imported: frozenset[str], expected: str) -> None:
    pytest.importorskip("lightning")
    assert _lightning.choose_namespace(environ, imported) == expected


def test_unknown_namespace_is_one_clear_error() -> None:
    with pytest.raises(ImportError, match=r"SSL_LIGHTNING_NAMESPACE='pl': expected 'lightning'"):
        _lightning.choose_namespace({"SSL_LIGHTNING_NAMESPACE": "pl"}, frozenset())


def test_command_line_refuses_the_lightning_namespace(monkeypatch, capsys) -> None:
    import ssl_lightning.cli as cli

    monkeypatch.setattr(cli, "NAMESPACE", "lightning")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "simclr"])
    assert exit_info.value.code == 2
    assert "command line runs on pytorch_lightning" in capsys.readouterr().err
