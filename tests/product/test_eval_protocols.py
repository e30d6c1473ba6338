"""``benchmarks/eval_protocols.py``: ``--random-init`` runs the protocols on the sanity baseline,
the backbone the checkpoint records (same class and shape), randomly initialised."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.backbones.spec import backbone_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import eval_protocols  # noqa: E402
import pretrain_knn  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, SmallConvNet]:
    """A checkpoint of a SmallConvNet (weights all 0.5, far from any initialisation) and a
    labelled 10-class image folder."""
    root = tmp_path_factory.mktemp("eval_protocols")
    pretrain_knn.write_tiny_images(root / "cifar10", seed=0)
    backbone = SmallConvNet(widths=(8, 16))
    with torch.no_grad():
        for parameter in backbone.parameters():
            parameter.fill_(0.5)
    path = root / "last.ckpt"
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in backbone.state_dict().items()},
                "backbone_spec": backbone_spec(backbone),
                "pytorch-lightning_version": "2.5.0"}, path)
    return path, root / "cifar10", backbone


def _knn(path: Path, data: Path, *flags: str):
    args = eval_protocols.parse([
        "--checkpoint", str(path), "--train-dir", str(data / "train"), "--val-dir",
        str(data / "test"), "--num-classes", "10", "--protocols", "knn", "--preset", "cifar",
        "--cnn", "--num-workers", "0", "--batch-size", "8", *flags,
        "--set=--trainer.accelerator=cpu", "--set=--trainer.logger=false",
        "--set=--trainer.callbacks=[]", "--set=--trainer.enable_progress_bar=false"])
    return eval_protocols.main(eval_protocols.protocol_args("knn", args)).model.backbone


def test_random_init_evaluates_the_recorded_backbone_shape_with_fresh_weights(
        checkpoint, one_thread) -> None:
    path, data, trained = checkpoint
    loaded = _knn(path, data)
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in loaded.state_dict().items())
    random = _knn(path, data, "--random-init")
    assert type(random) is SmallConvNet
    assert backbone_spec(random) == backbone_spec(trained)
    shapes = {k: v.shape for k, v in trained.state_dict().items()}
    assert {k: v.shape for k, v in random.state_dict().items()} == shapes
    weights = [k for k, v in random.state_dict().items() if k.endswith("weight") and v.dim() > 1]
    assert weights and not any(torch.equal(random.state_dict()[k], trained.state_dict()[k])
                               for k in weights)
    again = _knn(path, data, "--random-init")  # the configs' seed: the same baseline each time
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in random.state_dict().items())


def test_random_init_needs_a_recorded_backbone(tmp_path: Path, checkpoint) -> None:
    _, data, trained = checkpoint
    path = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in trained.state_dict().items()}},
               path)
    with pytest.raises(SystemExit, match="records no backbone"):
        _knn(path, data, "--random-init")
