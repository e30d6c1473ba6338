"""Issue 10, items 6 and 7: errors reach the user readably through ``ssl_lightning.cli.main``:
a constructor's ``ValueError`` as its own message, an unknown ``class_path`` with the closest
name and the available ones, ``sync_batchnorm`` on CPU processes refused before training, and a
backbone that is not an ``nn.Module`` instance named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.cli import main

CONFIG = """
trainer: {accelerator: cpu, devices: 1, max_steps: 1, logger: false}
model:
  class_path: SimCLR
  init_args:
    backbone: {class_path: SmallConvNet, init_args: {widths: [8, 16]}}
    projection_hidden_dim: 16
    projection_dim: 8
data:
  class_path: CIFAR10DataModule
  init_args: {batch_size: 4, num_workers: 0}
"""


@pytest.fixture
def fit(tmp_path: Path, tiny_image_folder: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(CONFIG)
    config["data"]["init_args"]["root"] = str(tiny_image_folder)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return lambda *args: main(["fit", "--config", str(path), *args])


def _stderr(capsys, fit, *args: str, code: int) -> str:
    with pytest.raises(SystemExit) as exit_info:
        fit(*args)
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Given value" not in err and "Subtypes" not in err, err
    assert len(err.splitlines()) <= 2, err
    return err


def test_constructor_value_error_is_printed_as_its_own_message(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.init_args.temperature", "-1", code=1)
    assert err.splitlines()[0] == "error: NTXentLoss temperature must be > 0, got -1.0."
    err = _stderr(capsys, fit, "--model.lr", "-1", code=1)
    assert err.splitlines()[0] == "error: lr must be > 0, got -1.0."


@pytest.mark.parametrize(("args", "suggestion", "listed"), [
    (["--model", "SimCRL"], "Did you mean 'SimCLR'?", "Available methods: BarlowTwins, BYOL"),
    (["--data", "CIFAR10DataModul"], "Did you mean 'CIFAR10DataModule'?",
     "Available data modules: CIFAR100DataModule, CIFAR10DataModule, ImageFolderDataModule"),
    (["--model.backbone", "SmallConvNett"], "Did you mean 'ssl_lightning.SmallConvNet'?",
     "Available backbones: ssl_lightning.ResNet, ssl_lightning.SmallConvNet"),
])
def test_unknown_class_path_suggests_the_closest_name(fit, capsys, args, suggestion,
                                                      listed) -> None:
    err = _stderr(capsys, fit, *args, code=2)
    assert f"unknown class {args[1]!r}" in err and suggestion in err and listed in err


def test_parser_errors_name_the_option_without_union_noise(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.optimizer", "adam", code=2)
    assert err.startswith("error: --model.optimizer: Expected a typing.Literal['lars', 'sgd', "
                          "'adamw']. Got value: adam")


def test_sync_batchnorm_on_cpu_processes_is_refused_before_training(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.head_batch_norm", "true", "--trainer.devices", "2",
                  "--trainer.strategy", "ddp_spawn", "--trainer.sync_batchnorm", "true", code=1)
    assert "SyncBatchNorm does not run on CPU" in err
    assert "Pass --trainer.sync_batchnorm false" in err


@pytest.mark.parametrize(("backbone", "got"), [
    (None, "got None (NoneType)"), (SmallConvNet, "got the class SmallConvNet itself")])
def test_backbone_must_be_a_module_instance(backbone, got) -> None:
    message = f"backbone must be an nn.Module instance, {got}"
    with pytest.raises(TypeError, match=re.escape(message)):
        SimCLR(backbone)


def test_a_trainer_misconfiguration_is_printed_as_its_own_message(fit, capsys) -> None:
    """Raised by ``Trainer.__init__`` itself (not through jsonargparse): still one line."""
    err = _stderr(capsys, fit, "--trainer.callbacks+=TQDMProgressBar",
                  "--trainer.enable_progress_bar", "false", code=1)
    assert err.startswith("error: MisconfigurationException: Trainer was configured with "
                          "`enable_progress_bar=False` but found `TQDMProgressBar`"), err
