"""The dense probes on synthetic images whose masks and depths are known by construction
(tests/dense_utils.py: a pixel's class and depth are functions of its colour): a frozen random
convolutional backbone's patch features suffice for near-perfect scores, and the known-bad
variants (a transposed patch grid) fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from dense_utils import make_depth_folder, make_segmentation_folder

import ssl_lightning.evaluation.dense.seg_knn as seg_knn
from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data.dense_pairs import DepthDataModule, SegmentationDataModule
from ssl_lightning.evaluation.dense import DenseKNNSegmentation, DepthLinearProbe, SegLinearProbe
from ssl_lightning.evaluation.dense.seg_knn import patch_label_distributions

TINY = {"crop_size": 32, "batch_size": 8, "num_workers": 0, "eval_size": None}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dense")
    make_segmentation_folder(root / "seg")
    make_depth_folder(root / "depth")
    return root


def _backbone() -> SmallConvNet:
    torch.manual_seed(0)
    return SmallConvNet(widths=(16, 32))  # an 8x8 map of 32 px images


def _trainer(steps: int = 0) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, check_val_every_n_epoch=10_000)


def _metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_linear_segmentation_is_near_perfect_on_colour_squares(data_root: Path) -> None:
    data = SegmentationDataModule(str(data_root / "seg"), num_classes=3, bank_images=0,
                                  scale_range=(1.0, 1.0), **TINY)
    probe = SegLinearProbe(_backbone(), num_classes=3, checkpoint="random", lrs=[1e-2, 1e-1],
                           crop_size=32, stride=16, image_size=32)
    trainer = _trainer(150)
    trainer.fit(probe, data)
    trainer.validate(probe, data, verbose=False)
    metrics = _metrics(trainer)
    assert metrics["val/miou"] > 93 and metrics["val/pixel_acc"] > 97, metrics
    assert metrics["val/miou"] == max(metrics["val/miou_lr0.01"], metrics["val/miou_lr0.1"])
    assert set(probe.results) == {"lr0.01", "lr0.1"}
    assert probe.results["lr0.1"]["iou"].shape == (3,)


def test_dense_knn_segmentation_is_near_perfect_and_needs_the_grid_order(
        data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = SegmentationDataModule(str(data_root / "seg"), num_classes=3, **TINY)
    knn = DenseKNNSegmentation(_backbone(), num_classes=3, checkpoint="random",
                               ks=[1, 3, 10, 30])
    trainer = _trainer()
    trainer.validate(knn, data, verbose=False)
    metrics = _metrics(trainer)
    assert min(metrics[f"val/miou_k{k}"] for k in (1, 3, 10, 30)) > 90, metrics
    # Known-bad: the patch grid transposed (tokens read column-major) mislabels the patches.
    frozen = seg_knn.patch_features
    monkeypatch.setattr(seg_knn, "patch_features", lambda b, x: frozen(b, x).transpose(-1, -2))
    trainer.validate(knn, data, verbose=False)
    assert _metrics(trainer)["val/miou"] < 75, _metrics(trainer)


def test_patch_labels_are_the_class_shares_of_their_pixels() -> None:
    masks = torch.tensor([[[0, 0, 1, 1], [0, 1, 255, 255], [2, 2, 2, 2], [2, 2, 2, 255]]])
    shares = patch_label_distributions(masks, (2, 2), 3)
    torch.testing.assert_close(shares[0, 0, 0], torch.tensor([0.75, 0.25, 0.0]))
    torch.testing.assert_close(shares[0, 0, 1], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(shares[0, 1, 1], torch.tensor([0.0, 0.0, 1.0]))


@pytest.mark.parametrize("output", ["bins", "regression"])
def test_linear_depth_is_near_perfect_when_depth_is_a_colour(data_root: Path,
                                                              output: str) -> None:
    data = DepthDataModule(str(data_root / "depth"), bank_images=0, scale_range=(1.0, 1.0),
                           **TINY)
    probe = DepthLinearProbe(_backbone(), checkpoint="random", output=output, num_bins=64,
                             max_depth=8.0, lrs=[1e-2, 1e-1], crop_size=32, stride=16,
                             image_size=32)
    trainer = _trainer(150)
    trainer.validate(probe, data, verbose=False)
    untrained = _metrics(trainer)["val/rmse"]
    trainer.fit(probe, data)
    trainer.validate(probe, data, verbose=False)
    metrics = _metrics(trainer)
    assert metrics["val/rmse"] < 0.25 and metrics["val/delta1"] > 0.95, metrics
    assert metrics["val/abs_rel"] < 0.08 and untrained > 4 * metrics["val/rmse"], untrained


def test_probes_refuse_a_class_count_that_is_not_the_data(data_root: Path) -> None:
    data = SegmentationDataModule(str(data_root / "seg"), num_classes=3, bank_images=0, **TINY)
    probe = SegLinearProbe(_backbone(), num_classes=4, checkpoint="random", crop_size=32,
                           image_size=32)
    with pytest.raises(ValueError, match="num_classes=4 but the data has 3"):
        _trainer(1).fit(probe, data)
