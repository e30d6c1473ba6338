"""ExportBackbone: the backbone exported at the end of a finished fit, in its own format, and
the printed lines load it; nothing after a failed or debugging run; bad settings refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from evaluation_helpers import tiny_trainer
from torch import nn
from torch.utils.data import DataLoader

from ssl_lightning.backbones import SmallConvNet, TimmBackbone
from ssl_lightning.evaluation import ExportBackbone
from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import PrecomputedViews


def fit_simclr(backbone: nn.Module, root: Path, callback: ExportBackbone, model_class=SimCLR,
               **trainer_kwargs) -> SimCLR:
    model = model_class(backbone, projection_hidden_dim=16, projection_dim=8, optimizer="sgd",
                        lr=0.1, lr_scaling="none", warmup_epochs=0)
    trainer = tiny_trainer(max_steps=2, default_root_dir=str(root), callbacks=[callback],
                           **trainer_kwargs)
    trainer.fit(model, DataLoader(PrecomputedViews(8, (32, 32)), batch_size=4))
    return model


@pytest.mark.parametrize("kind", ["timm", "state_dict"])
def test_exported_backbone_loads_with_the_printed_lines(tmp_path, monkeypatch, capsys, kind):
    if kind == "timm":
        pytest.importorskip("timm")
        backbone: nn.Module = TimmBackbone("vit_tiny_patch16_224", model_kwargs={"img_size": 32})
    else:
        backbone = SmallConvNet(widths=(8, 16))
    callback = ExportBackbone()
    model = fit_simclr(backbone, tmp_path, callback)
    monkeypatch.chdir(tmp_path)
    out = capsys.readouterr().out
    assert callback.path == str(tmp_path / "export" / "backbone.pt")
    assert f"({kind} format) to {callback.path}. Load it with:\n{callback.snippet}" in out
    namespace: dict = {}
    exec(callback.snippet, namespace)  # type: ignore[arg-type]
    loaded = namespace["model" if kind == "timm" else "backbone"].eval()
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same modules and weights: the same kernels, bit for bit
        assert torch.equal(loaded(images), model.backbone.eval()(images))


class FailsAtSecondStep(SimCLR):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("stop here")
        return super().training_step(batch, batch_idx)


def test_no_export_after_an_exception_under_fast_dev_run_or_when_disabled(tmp_path):
    with pytest.raises(RuntimeError, match="stop here"):
        fit_simclr(SmallConvNet(widths=(8,)), tmp_path / "failed", ExportBackbone(),
                   model_class=FailsAtSecondStep)
    fit_simclr(SmallConvNet(widths=(8,)), tmp_path / "debug", ExportBackbone(), fast_dev_run=True)
    fit_simclr(SmallConvNet(widths=(8,)), tmp_path / "off", ExportBackbone(enabled=False))
    assert not list(tmp_path.rglob("*.pt"))
    fit_simclr(SmallConvNet(widths=(8,)), tmp_path / "done", ExportBackbone())
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*.pt")] == [
        Path("done/export/backbone.pt")]


def test_bad_settings_are_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"format 'onnx' is not one of .*ssl_lightning export"):
        ExportBackbone(format="onnx")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no module 'teacher_backbone' \(its modules: "
                                         r"\['backbone\.', 'projector\.', 'criterion\.'\]\)"):
        fit_simclr(SmallConvNet(widths=(8,)), tmp_path, ExportBackbone(prefix="teacher_backbone."))
    with pytest.raises(ValueError, match="format 'timm' does not fit the backbone SmallConvNet "
                                         r"\(its format is 'state_dict'\)"):
        fit_simclr(SmallConvNet(widths=(8,)), tmp_path, ExportBackbone(format="timm"))
    assert not list(tmp_path.rglob("*.pt"))


def test_the_shared_pretraining_callbacks_export_unless_switched_off_on_the_command_line():
    from ssl_lightning.cli import main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "simclr.yaml")
    for extra, enabled in [([], True), (["--trainer.callbacks.init_args.enabled", "false"], False)]:
        cli = main(["--config", config, "--trainer.accelerator", "cpu", *extra], run=False)
        (export,) = [c for c in cli.trainer.callbacks if isinstance(c, ExportBackbone)]
        assert export.enabled is enabled
