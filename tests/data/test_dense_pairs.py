"""Dense-probe data: the folder layouts and label conventions, the paired random crop and
flip, and the errors for bad pairs (ssl_lightning/data/dense_pairs.py, dense_layouts.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dense_utils import COLOURS, DEPTHS, make_depth_folder, make_segmentation_folder
from PIL import Image

from ssl_lightning.data.dense_layouts import IGNORE_INDEX, read_depth, read_mask
from ssl_lightning.data.dense_pairs import (
    DensePairs,
    DepthDataModule,
    SegmentationDataModule,
)
from ssl_lightning.data.seeding import SeededDataset


@pytest.fixture(scope="module")
def seg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_segmentation_folder(tmp_path_factory.mktemp("seg"))


def _save(path: Path, array: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode).save(path)


def test_ade20k_layout_reduces_the_zero_label(tmp_path: Path) -> None:
    labels = np.array([[0, 1], [150, 2]], dtype=np.uint8)
    for split in ("training", "validation"):
        _save(tmp_path / "images" / split / "a.jpg", np.zeros((2, 2, 3), np.uint8))
        _save(tmp_path / "annotations" / split / "a.png", labels)
    data = SegmentationDataModule(str(tmp_path), num_classes=150, layout="ade20k")
    data.setup("fit")
    assert data.train_pairs == [(tmp_path / "images/training/a.jpg",
                                 tmp_path / "annotations/training/a.png")]
    mask = data.read_target(data.train_pairs[0][1])
    assert mask.tolist() == [[IGNORE_INDEX, 0], [149, 1]]


def test_voc_palette_masks_read_as_class_indices(tmp_path: Path) -> None:
    indices = np.array([[0, 15], [255, 20]], dtype=np.uint8)
    image = Image.fromarray(indices, "P")
    image.putpalette([v for i in range(256) for v in (i, 255 - i, (7 * i) % 256)])
    (tmp_path / "SegmentationClass").mkdir()
    image.save(tmp_path / "SegmentationClass" / "2007_000032.png")
    _save(tmp_path / "JPEGImages" / "2007_000032.jpg", np.zeros((2, 2, 3), np.uint8))
    (tmp_path / "ImageSets" / "Segmentation").mkdir(parents=True)
    for split in ("train", "val"):
        (tmp_path / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("2007_000032\n")
    data = SegmentationDataModule(str(tmp_path), num_classes=21, layout="voc")
    data.setup("fit")
    assert data.read_target(data.val_pairs[0][1]).tolist() == [[0, 15], [IGNORE_INDEX, 20]]


def test_cityscapes_train_ids_pair_with_their_images(tmp_path: Path) -> None:
    for split in ("train", "val"):
        _save(tmp_path / "leftImg8bit" / split / "aachen" / "aachen_000000_000019_leftImg8bit.png",
              np.zeros((2, 2, 3), np.uint8))
        _save(tmp_path / "gtFine" / split / "aachen" /
              "aachen_000000_000019_gtFine_labelTrainIds.png",
              np.array([[18, 255], [0, 3]], np.uint8))
    data = SegmentationDataModule(str(tmp_path), num_classes=19, layout="cityscapes")
    data.setup("fit")
    assert data.read_target(data.train_pairs[0][1]).tolist() == [[18, IGNORE_INDEX], [0, 3]]


def test_depth_png_is_millimetres_and_npy_metres(tmp_path: Path) -> None:
    _save(tmp_path / "d.png", np.array([[1500, 0]], np.uint16))
    np.save(tmp_path / "d.npy", np.array([[1.5, 0.0]], np.float32))
    assert read_depth(tmp_path / "d.png").tolist() == [[1.5, 0.0]]
    assert read_depth(tmp_path / "d.npy").tolist() == [[1.5, 0.0]]


def test_depth_folder_pairs_and_values(tmp_path: Path) -> None:
    data = DepthDataModule(str(make_depth_folder(tmp_path, train=2, val=1)), crop_size=16)
    data.setup("fit")
    image, depth = DensePairs(data.train_pairs, data.read_target, lambda i, t: (i, t))[0]
    colour = (image * 255).round().long().permute(1, 2, 0)
    expected = torch.zeros_like(depth)
    for c, metres in enumerate(DEPTHS):
        expected[(colour == torch.from_numpy(COLOURS[c]).long()).all(-1)] = float(metres)
    torch.testing.assert_close(depth, expected, rtol=0, atol=1e-6)


def _bad_folder(tmp_path: Path) -> Path:
    root = make_segmentation_folder(tmp_path, train=2, val=1)
    return root


def test_a_missing_mask_is_named(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path)
    (root / "train" / "masks" / "1.png").unlink()
    with pytest.raises(ValueError, match=r"train/images/1.png has no .*train/masks/1.png"):
        SegmentationDataModule(str(root), num_classes=3).setup("fit")


def test_mismatched_sizes_are_named(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path)
    _save(root / "val" / "masks" / "0.png", np.zeros((16, 32), np.uint8))
    with pytest.raises(ValueError, match=r"val/images/0.png is \(32, 32\).*val/masks/0.png is "
                                         r"\(16, 32\)"):
        SegmentationDataModule(str(root), num_classes=3).setup("fit")


def test_a_label_out_of_range_is_named(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path)
    _save(root / "train" / "masks" / "0.png", np.full((32, 32), 7, np.uint8))
    with pytest.raises(ValueError, match=r"train/masks/0.png holds the label 7, outside the 3 "):
        SegmentationDataModule(str(root), num_classes=3).setup("fit")
    assert read_mask(root / "train" / "masks" / "0.png", 8).max() == 7  # fine with 8 classes


def _class_of_colour(image: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The class each pixel's colour says (-1 for no class colour, e.g. padding)."""
    rgb = ((image * std + mean) * 255).round().long().permute(1, 2, 0)
    classes = torch.full(rgb.shape[:2], -1, dtype=torch.long)
    for c, colour in enumerate(COLOURS):
        classes[(rgb - torch.from_numpy(colour).long()).abs().max(-1).values <= 1] = c
    return classes


def test_crop_and_flip_move_the_mask_with_its_image(seg_root: Path) -> None:
    """Every pixel whose colour is exact keeps its class after the random scale, crop and
    flip (interpolated borders aside), and the draws differ between samples."""
    data = SegmentationDataModule(str(seg_root), num_classes=3, crop_size=24,
                                  scale_range=(1.0, 1.6))
    data.setup("fit")
    transform = data.train_transform
    dataset = SeededDataset(DensePairs(data.train_pairs, data.read_target, transform), seed=0)
    agree = []
    for index in range(8):
        image, mask, _ = dataset[(0, index)]
        assert image.shape == (3, 24, 24) and mask.shape == (24, 24)
        colour = _class_of_colour(image, transform.mean, transform.std)
        known = (colour >= 0) & (mask != IGNORE_INDEX)
        agree.append(float((colour[known] == mask[known]).double().mean()))
        again, mask_again, _ = dataset[(0, index)]
        assert torch.equal(image, again) and torch.equal(mask, mask_again)
    assert min(agree) > 0.97, agree


def test_each_sample_gets_its_own_crop(seg_root: Path) -> None:
    data = SegmentationDataModule(str(seg_root), num_classes=3, crop_size=16)
    data.setup("fit")
    dataset = SeededDataset(DensePairs(data.train_pairs, data.read_target,
                                       data.train_transform), seed=0)
    first = [dataset[(0, 0)][0], dataset[(1, 0)][0], dataset[(2, 0)][0]]
    assert not torch.equal(first[0], first[1]) or not torch.equal(first[1], first[2])


def test_batches_and_loaders(seg_root: Path) -> None:
    data = SegmentationDataModule(str(seg_root), num_classes=3, crop_size=16, batch_size=4,
                                  num_workers=0, eval_size=None, bank_images=5)
    images, masks, seeds = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 16, 16) and masks.shape == (4, 16, 16)
    assert masks.dtype == torch.int64 and seeds.dtype == torch.int64
    bank, queries = data.val_dataloader()
    assert len(bank.dataset) == 5 and len(queries.dataset) == 4
    image, mask = next(iter(queries))
    assert image.shape == (1, 3, 32, 32) and mask.shape == (1, 32, 32)
