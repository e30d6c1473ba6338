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
from ssl_lightning.backbones import SmallConvNet, ViT
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


@pytest.mark.parametrize("token_backbone", [False, True], ids=["convnet", "vit"])
def test_dense_knn_segmentation_is_near_perfect_and_needs_the_grid_order(
        data_root: Path, monkeypatch: pytest.MonkeyPatch, token_backbone: bool) -> None:
    """A CNN's map and a ViT's patch tokens on their grid (8 px patches)."""
    torch.manual_seed(0)
    backbone = ViT(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2) \
        if token_backbone else _backbone()
    data = SegmentationDataModule(str(data_root / "seg"), num_classes=3, **TINY)
    knn = DenseKNNSegmentation(backbone, num_classes=3, checkpoint="random",
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


def test_a_bad_mask_stops_the_cli_before_training_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the real CLI on configs/seg_linear.yaml: a label out of range is one ``error:``
    line naming the file, before any step."""
    import numpy as np
    from PIL import Image

    from ssl_lightning.cli import main

    root = make_segmentation_folder(tmp_path / "seg", train=4, val=2)
    Image.fromarray(np.full((32, 32), 9, np.uint8)).save(root / "val" / "masks" / "1.png")
    config = Path(__file__).resolve().parents[2] / "configs" / "seg_linear.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--model.checkpoint", "random",
              "--model.backbone", '{"class_path": "ssl_lightning.SmallConvNet", '
              '"init_args": {"widths": [8, 16]}}', "--model.num_classes", "3",
              "--model.image_size", "32", "--model.crop_size", "32", "--model.stride", "null",
              "--data.root", str(root),
              "--data.layout", "folders", "--data.num_classes", "3", "--data.crop_size", "32",
              "--data.num_workers", "0", "--trainer.accelerator", "cpu",
              "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "val/masks/1.png holds the label 9" in err[-1], err
    assert "Traceback" not in "\n".join(err)


def _knn_ranks(rank: int, world: int, root: str) -> torch.Tensor:
    """Dense kNN with the bank and queries split over ranks as DistributedSampler splits them."""
    data = SegmentationDataModule(root, num_classes=3, **TINY)
    data.setup("validate")
    bank, queries = (loader.dataset for loader in data.val_dataloader())
    knn = DenseKNNSegmentation(_backbone(), num_classes=3, checkpoint="random", ks=[1, 3, 10])
    for matrix in knn.matrices.values():
        matrix.counts.zero_()
    for i in range(rank, len(bank), world):
        image, mask = bank[i]
        knn.add_to_bank(image[None], mask[None], [i])
    for i in range(rank, len(queries), world):
        image, mask = queries[i]
        for k, dist in knn.label_maps(image[None]).items():
            full = torch.nn.functional.interpolate(dist, size=mask.shape, mode="bilinear",
                                                   align_corners=False)
            knn.matrices[k].update(full.argmax(dim=1), mask[None])
    return torch.stack([knn.matrices[k].compute()["miou"] for k in (1, 3, 10)])


@pytest.mark.slow
def test_dense_knn_on_two_processes_gives_the_scores_of_one(data_root: Path) -> None:
    from distributed_utils import run_in_processes

    one = _knn_ranks(0, 1, str(data_root / "seg"))
    for result in run_in_processes(_knn_ranks, 2, str(data_root / "seg")):
        torch.testing.assert_close(result, one, rtol=0, atol=1e-9)


def _validate_probes(rank: int, world: int, seg_root: str, depth_root: str) -> torch.Tensor:
    """Every dense probe's val scores (float64 metrics) through ``Trainer.validate``: ``ddp``
    in the pool's process group on 2 processes (its ranks told to Lightning), one process
    otherwise. 5 bank and 5 val images, so rank 1's last batches are DistributedSampler's
    padding; the kNN keeps a random subset of each bank image's patches."""
    import os
    import tempfile

    if world > 1:  # Lightning reads the ranks from here; without them all would be rank 0
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    common = {"checkpoint": "random", "crop_size": 32, "stride": 16, "image_size": 32}
    runs = [(SegLinearProbe(_backbone(), num_classes=3, lrs=[0.1, 0.2], **common),
             SegmentationDataModule(seg_root, num_classes=3, bank_images=0, **TINY)),
            (DepthLinearProbe(_backbone(), num_bins=8, lrs=[0.1], **common),
             DepthDataModule(depth_root, bank_images=0, **TINY)),
            (DenseKNNSegmentation(_backbone(), num_classes=3, checkpoint="random", ks=[1, 10],
                                  patches_per_image=8),
             SegmentationDataModule(seg_root, num_classes=3, **TINY))]
    torch.set_num_threads(1)  # the same kernels as the one-process run
    generator = torch.Generator().manual_seed(1)
    for probe, _ in runs[:2]:  # untrained heads of std 1: no near-ties between outputs
        for head in probe.heads:
            head[1].weight.data.normal_(generator=generator)
    values = []
    for probe, data in runs:
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(accelerator="cpu", devices=world,
                                 strategy="ddp" if world > 1 else "auto", logger=False,
                                 enable_progress_bar=False, enable_model_summary=False,
                                 default_root_dir=root)
            trainer.validate(probe, data, verbose=False)
        values += [v.double().flatten() for scores in probe.results.values()
                   for v in scores.values()]
    return torch.cat(values)


@pytest.mark.slow
def test_every_dense_probe_validates_on_two_processes_as_on_one(tmp_path: Path) -> None:
    from distributed_utils import run_in_processes

    seg = str(make_segmentation_folder(tmp_path / "seg", train=5, val=5))
    depth = str(make_depth_folder(tmp_path / "depth", train=5, val=5))
    one = _validate_probes(0, 1, seg, depth)
    assert len(one) == 23  # 2 + 1 heads' scores, 2 ks' scores
    for result in run_in_processes(_validate_probes, 2, seg, depth):
        torch.testing.assert_close(result, one, rtol=0, atol=1e-9, equal_nan=True)
