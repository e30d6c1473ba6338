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
    return eval_protocols.main(eval_protocols.protocol_args("knn", args, str(path.parent))
                               ).model.backbone


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


def test_a_best_head_at_the_edge_of_the_learning_rate_grid_is_marked() -> None:
    """A best head at the grid's largest learning rate says the probe may be under-trained
    (short runs on small real subsets); one inside the grid is reported as it is."""
    from types import SimpleNamespace

    from ssl_lightning.callbacks.probe_grid import probe_grid

    specs = probe_grid([1e-3, 1e-2, 0.1], [0.0], [1], ["pooled"])
    metrics = {"val/top1": 40.0}
    top = eval_protocols.rows("linear_grid", metrics, SimpleNamespace(specs=specs, best_head=2))
    assert top == [("linear_grid", "best head blocks1_pooled_lr0.1_wd0 (3 heads) (lr at the "
                    "grid's edge: under-trained? more epochs)", 40.0)]
    low = eval_protocols.rows("linear_grid", metrics, SimpleNamespace(specs=specs, best_head=0))
    assert low[0][1].endswith("(lr at the grid's edge: extend the grid down)")
    inside = eval_protocols.rows("attentive", metrics, SimpleNamespace(specs=specs, best_head=1))
    assert inside == [("attentive", "best head blocks1_pooled_lr0.01_wd0 (3 heads)", 40.0)]


def test_knn_rows_come_in_temperature_then_k_order() -> None:
    metrics = {f"val/knn_k{k}_t{t}_top1": float(k) + t for t in (0.2, 0.07) for k in (200, 10)}
    metrics |= {"val/knn_top1": 1.0, "val/knn_k10_t0.07_top5": 2.0}
    assert eval_protocols.rows("knn", metrics, None) == [
        ("knn", "k10_t0.07", 10.07), ("knn", "k200_t0.07", 200.07),
        ("knn", "k10_t0.2", 10.2), ("knn", "k200_t0.2", 200.2)]


def test_every_protocol_runs_in_its_own_directory(tmp_path: Path, monkeypatch, checkpoint) -> None:
    """Each protocol gets its own run directory, not the working directory: two runs of the
    script at once (a checkpoint and its random-init baseline) once failed with
    ``RunDirectoryInUseError`` on the working directory's ``run.lock``."""
    from types import SimpleNamespace

    from ssl_lightning.callbacks.probe_grid import probe_grid

    path, data, _ = checkpoint
    seen: list[str] = []

    def fake_main(cli: list[str]) -> SimpleNamespace:
        folder = cli[cli.index("--trainer.default_root_dir") + 1]
        assert Path(folder).is_dir()
        seen.append(folder)
        metrics = {"val/knn_k10_t0.07_top1": 1.0, "val/top1": 2.0}
        model = SimpleNamespace(specs=probe_grid([0.1], [0.0]), best_head=0)
        return SimpleNamespace(trainer=SimpleNamespace(callback_metrics=metrics), model=model)

    monkeypatch.setattr(eval_protocols, "main", fake_main)
    monkeypatch.chdir(tmp_path)
    eval_protocols.run(["--checkpoint", str(path), "--train-dir", str(data / "train"),
                        "--val-dir", str(data / "test"), "--num-classes", "10",
                        "--protocols", "knn", "linear_grid", "--cnn"])
    assert len(set(seen)) == 2 and str(tmp_path) not in seen
    assert not any(Path(folder).exists() for folder in seen)  # removed after each protocol
    assert list(tmp_path.iterdir()) == []
