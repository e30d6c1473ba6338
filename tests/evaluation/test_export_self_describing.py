"""Exports are self-describing: every format records its preprocessing, and the printed lines
that load it run as printed (executed here) and give the checkpoint's features."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ssl_lightning.backbones import ResNet, SmallConvNet, TimmBackbone, TorchvisionBackbone, ViT
from ssl_lightning.data import EvalTransform
from ssl_lightning.evaluation.export import main
from ssl_lightning.evaluation.export_metadata import ONNX_KEY

RECORD = EvalTransform("cifar", crop_size=16, resize_size=20).settings


def _checkpoint(path, backbone: nn.Module) -> str:
    """A checkpoint as a run writes it: weights, the backbone's spec and the preprocessing."""
    state = {f"backbone.{k}": v for k, v in backbone.state_dict().items()}
    torch.save({"state_dict": state, "backbone_spec": backbone.backbone_spec,
                "preprocessing": dict(RECORD)}, path)
    return str(path)


def _export(capsys, ckpt: str, out: str, *args: str, **inputs) -> tuple[dict, dict]:
    """Export, execute the printed load lines in a fresh namespace (holding only ``inputs``:
    the images the ONNX / TorchScript lines use); return it and the sidecar."""
    main(["--checkpoint", ckpt, "--output", out, *args])
    printed = capsys.readouterr().out
    assert "export: preprocessing the checkpoint's" in printed
    scope: dict = dict(inputs)
    exec(printed.split("Load it with:\n", 1)[1], scope)  # noqa: S102 - the lines as printed
    with open(f"{out}.json", encoding="utf-8") as handle:
        return scope, json.load(handle)


BACKBONES = {
    "SmallConvNet": lambda: SmallConvNet((8, 16)),
    "ResNet": lambda: ResNet(18, cifar_stem=True),
    "ViT": lambda: ViT("tiny", image_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2),
    "TorchvisionBackbone": lambda: TorchvisionBackbone("resnet18", cifar_stem=True),
    "TimmBackbone": lambda: TimmBackbone("resnet18"),
}


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_the_printed_lines_load_every_backbone_class_with_its_features(name, tmp_path, capsys):
    backbone = BACKBONES[name]().eval()
    ckpt = _checkpoint(tmp_path / "m.ckpt", backbone)
    scope, sidecar = _export(capsys, ckpt, str(tmp_path / "backbone.pt"))
    assert sidecar["preprocessing"] == RECORD
    model = scope.get("model", scope.get("backbone"))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), backbone(x), rtol=0, atol=1e-6)
    if name == "TimmBackbone":  # timm reads the preprocessing from the model's pretrained_cfg
        import timm

        config = timm.data.resolve_data_config({}, model=model)
        assert config["input_size"] == (3, 16, 16) and config["crop_pct"] == 16 / 20
        assert config["mean"] == tuple(RECORD["mean"]) and config["std"] == tuple(RECORD["std"])
        assert config["interpolation"] == "bilinear"


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_onnx_and_torchscript_exports_record_their_preprocessing(fmt, tmp_path, capsys):
    backbone = SmallConvNet((8, 16)).eval()
    ckpt = _checkpoint(tmp_path / "m.ckpt", backbone)
    out = str(tmp_path / f"backbone.{fmt}")
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = backbone(x)
        scope, sidecar = _export(capsys, ckpt, out, "--format", fmt, images=x,
                                 images_nchw_float32=x.numpy())
    assert sidecar["preprocessing"] == RECORD and sidecar["format"] == fmt
    if fmt == "onnx":
        import onnx

        props = {p.key: p.value for p in onnx.load(out).metadata_props}
        assert json.loads(props[ONNX_KEY]) == RECORD
        torch.testing.assert_close(torch.from_numpy(scope["features"]), expected, rtol=0,
                                   atol=1e-5)
    else:
        torch.testing.assert_close(scope["features"], expected, rtol=0, atol=1e-6)


def test_the_export_at_the_end_of_fit_records_the_runs_preprocessing(tiny_image_folder,
                                                                      tmp_path):
    from evaluation_helpers import tiny_trainer

    from ssl_lightning.data import ImageFolderDataModule
    from ssl_lightning.evaluation import ExportBackbone
    from ssl_lightning.methods import SimCLR

    data = ImageFolderDataModule(str(tiny_image_folder / "train"), preset="cifar", batch_size=4,
                                 num_workers=0, persistent_workers=False, pin_memory=False)
    model = SimCLR(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                   optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
    callback = ExportBackbone()
    tiny_trainer(max_steps=1, default_root_dir=str(tmp_path), callbacks=[callback]).fit(
        model, datamodule=data)
    with open(f"{callback.path}.json", encoding="utf-8") as handle:
        sidecar = json.load(handle)
    assert sidecar["preprocessing"] == EvalTransform("cifar").settings
    assert sidecar["load"] == callback.snippet
