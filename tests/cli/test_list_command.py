"""``python -m ssl_lightning list methods|backbones|configs [--filter]``: every method and config
that ships, and backbones of ours, torchvision's and timm's by name, each with how to name it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ssl_lightning
import ssl_lightning.methods
from ssl_lightning.cli import main
from ssl_lightning.methods import SSLMethod

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_methods_lists_every_method_with_its_config() -> None:
    rows = dict(main(["list", "methods"]))
    exported = {name for name in ssl_lightning.__all__
                if isinstance(getattr(ssl_lightning, name), type)
                and issubclass(getattr(ssl_lightning, name), SSLMethod)}
    assert set(rows) == exported - {"SSLMethod", "MomentumMethod"}
    assert rows["SimCLR"] == ("SimCLR (contrastive): A Simple Framework for Contrastive Learning "
                              "of Visual Representations (2020, arXiv:2002.05709) "
                              "[--config simclr]")
    assert "--config moco_v3_vit" in rows["MoCoV3"]


def test_configs_lists_every_shipped_config() -> None:
    rows = dict(main(["list", "configs"]))
    assert set(rows) == {path.name for path in (ROOT / "configs").glob("*.yaml")} | {
        "shared/fsdp.yaml", "shared/streaming.yaml"}
    assert rows["linear.yaml"].startswith("LinearEval: ")
    assert rows["shared/fsdp.yaml"].startswith("piece: Sharded (FSDP2) training")


def test_backbones_filter_reaches_torchvision_and_timm() -> None:
    pytest.importorskip("timm")
    rows = dict(main(["list", "backbones", "--filter", "vit_small"]))
    assert "timm: vit_small_patch16_224" in rows
    assert rows["timm: vit_small_patch16_224"] == (
        "--model.backbone TimmBackbone --model.backbone.init_args.name vit_small_patch16_224")
    assert not any(name.startswith("timm: resnet") for name in rows)
    assert {"ResNet", "ViT", "TorchvisionBackbone", "TimmBackbone"} <= set(rows)
    resnets = dict(main(["list", "backbones", "--filter", "resnet1*"]))
    assert "torchvision: resnet18" in resnets and "torchvision: resnet50" not in resnets


def test_the_printed_name_builds_a_backbone() -> None:
    rows = dict(main(["list", "backbones", "--filter", "resnet18"]))
    from ssl_lightning import TorchvisionBackbone
    from ssl_lightning.backbones import feature_dim

    name = rows["torchvision: resnet18"].rsplit(" ", 1)[1]
    assert feature_dim(TorchvisionBackbone(name=name)) == 512


def test_list_runs_as_a_command() -> None:
    out = subprocess.run([sys.executable, "-m", "ssl_lightning", "list", "methods"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.splitlines()[0].split()[0] in ssl_lightning.methods.__all__, out
    wrong = subprocess.run([sys.executable, "-m", "ssl_lightning", "list", "losses"],
                           capture_output=True, text=True, cwd=ROOT)
    assert wrong.returncode == 2 and "invalid choice: 'losses'" in wrong.stderr
