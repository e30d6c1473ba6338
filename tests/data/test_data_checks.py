"""Data mistakes that used to pass silently: high-depth images, mismatched / missing / single
classes, class-sorted evaluation under ``limit_val_batches`` (1 process and DDP shards), and
train / eval transforms of different sizes."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.callbacks import KNNCallback
from ssl_lightning.callbacks.knn import padding_mask
from ssl_lightning.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    CorruptImageError,
    ImageFolderDataModule,
    ImageFolderDataset,
    SimCLRViews,
)
from ssl_lightning.data.checks import balanced_order
from ssl_lightning.data.datasets import load_image

LOADER = {"num_workers": 0, "batch_size": 4}
RAMP = (np.arange(16 * 16).reshape(16, 16) * 256).astype(np.uint16)  # 0 .. 65280
DARK = (RAMP // 64).astype(np.uint16)  # 0 .. 1020: stays dark (a per-image stretch would not)


# ------------------------------------------------------------------ 16-bit and float images
@pytest.mark.parametrize(("name", "array", "expected"), [
    ("i16.png", RAMP, np.rint(RAMP / 257.0)),             # PIL opens it as I;16
    ("i16.tif", RAMP, np.rint(RAMP / 257.0)),
    ("dark.png", DARK, np.rint(DARK / 257.0)),
    ("i32.tif", RAMP.astype(np.int32), np.rint(RAMP / 257.0)),  # mode I
    ("f.tif", (RAMP / 65535.0).astype(np.float32), np.rint(RAMP / 257.0)),  # mode F in [0, 1]
])
def test_high_depth_images_are_scaled_to_8_bit(tmp_path, name, array, expected):
    path = tmp_path / name
    Image.fromarray(array).save(path)
    assert Image.open(path).mode in ("I;16", "I", "F")
    rgb = np.asarray(load_image(path))
    assert rgb.shape == (16, 16, 3) and rgb.dtype == np.uint8
    np.testing.assert_allclose(rgb[..., 0], expected, atol=1)  # was 255 (white) everywhere
    assert (rgb[..., 0] == rgb[..., 2]).all()


@pytest.mark.parametrize(("array", "found"), [
    (np.full((4, 4), 70000, dtype=np.int32), r"\[70000, 70000\], outside the \[0, 65535\]"),
    (np.full((4, 4), 3.5, dtype=np.float32), r"\[3.5, 3.5\], outside the \[0, 1\]"),
])
def test_out_of_range_high_depth_images_are_refused(tmp_path, array, found):
    path = tmp_path / "bad.tif"
    Image.fromarray(array).save(path)
    with pytest.raises(CorruptImageError, match=f"{path}: its mode .* values lie in {found}"):
        load_image(path)


# ------------------------------------------------------------------ class lists
@pytest.fixture(scope="module")
def folders(tmp_path_factory, make_image_folder) -> Path:
    """``eleven/{train,test}``: 11 classes; ``three/train`` + ``two/test``: classes 0-2 vs 0-1;
    ``one/class_0``: a single class folder; ``odd``: 3 classes x 3 (an odd count)."""
    root = tmp_path_factory.mktemp("audit_folders")
    for split in ("train", "test"):
        make_image_folder(root / "eleven" / split, classes=11, per_class=1, size=8)
    make_image_folder(root / "three" / "train", classes=3, per_class=4, size=8)
    make_image_folder(root / "three" / "test", classes=2, per_class=2, size=8)
    make_image_folder(root / "one", classes=1, per_class=4, size=8)
    make_image_folder(root / "odd", classes=3, per_class=3, size=8)
    return root


def test_cifar10_module_on_data_with_more_classes_is_refused(folders):
    dm = CIFAR10DataModule(root=str(folders / "eleven"), **LOADER)
    with pytest.raises(ValueError, match=r"holds 11 classes but CIFAR10DataModule expects 10: "
                                         r"labels >= 10 would break .* CIFAR100DataModule"):
        dm.setup("validate")


def test_cifar100_module_on_cifar10_like_data_warns(tiny_image_folder):
    dm = CIFAR100DataModule(root=str(tiny_image_folder), **LOADER)
    with pytest.warns(UserWarning, match=r"holds 2 classes but CIFAR100DataModule expects 100"):
        dm.setup("validate")


def test_val_split_missing_a_class_is_refused(folders):
    dm = CIFAR10DataModule(root=str(folders / "three"), **LOADER)
    with pytest.raises(ValueError, match=r"has 3 classes and the val split .* has 2: missing "
                                         r"from val \['class_2'\], missing from train \[\]"):
        dm.setup("fit")


def test_single_class_evaluation_is_refused(folders):
    flat = folders / "three" / "train" / "class_0"
    dm = ImageFolderDataModule(str(flat), str(folders / "one"), preset="cifar", **LOADER)
    with pytest.raises(ValueError, match=r"single class \['class_0'\]: kNN and probe would "
                                         r"report 100 %"):
        dm.setup("fit")


def test_single_class_train_folder_is_unlabeled_or_refused(folders):
    dm = ImageFolderDataModule(str(folders / "one"), preset="cifar", **LOADER)
    dm.setup("fit")  # one class folder carries no label: pre-train unlabeled
    assert dm.num_classes is None and set(dm.train_dataset.targets) == {-1}
    dm = ImageFolderDataModule(str(folders / "one"), train_labeled=True, preset="cifar", **LOADER)
    with pytest.raises(ValueError, match=r"train_labeled: true, but .*one has 1 class folder"):
        dm.setup("fit")


# ------------------------------------------------------------------ evaluation order
def test_balanced_order_prefixes_hold_every_class(tiny_image_folder):
    dataset = ImageFolderDataset(tiny_image_folder / "train")  # class-sorted: 12 x 0, 12 x 1
    order = balanced_order(dataset)
    assert sorted(order) == list(range(24)) and order == balanced_order(dataset)
    targets = [dataset.targets[i] for i in order]
    for n in range(2, 25, 2):  # every even prefix: exactly half of each class
        assert targets[:n].count(0) == n // 2


def test_limited_eval_batches_see_every_class_on_one_and_two_processes(folders):
    odd = str(folders / "odd")
    dm = ImageFolderDataModule(odd, odd, preset="cifar", num_workers=0, batch_size=4)
    dm.setup("validate")
    bank = dm.val_dataloader()[0]
    assert set(next(iter(bank))[1].tolist()) == {0, 1, 2}  # was [0, 0, 0, 1]
    # Under DDP Lightning gives the loader DistributedSampler(shuffle=False): rank r gets
    # positions r, r + W, ...; 9 samples over 2 ranks pad one duplicate, masked by the kNN.
    seen, first_batches = [], []
    for rank in range(2):
        sampler = DistributedSampler(bank.dataset, num_replicas=2, rank=rank, shuffle=False)
        loader = DataLoader(bank.dataset, batch_size=2, sampler=sampler)
        targets = torch.cat([t for _, t in loader])
        keep = padding_mask(len(targets), sampler, targets.device)
        seen += targets[keep].tolist()
        first_batches += next(iter(loader))[1].tolist()
    assert sorted(seen) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every sample once, padding dropped
    assert set(first_batches) == {0, 1, 2}  # limit_val_batches=1 on 2 ranks: every class


def _noise_folder(root: Path, classes: int, per_class: int) -> None:
    """Classes drawn from the same noise: only a bug (one class per batch) scores 100 %."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for j in range(per_class):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{j}.png")


def test_knn_with_limit_val_batches_on_class_sorted_data(tmp_path):
    for split in ("train", "test"):
        _noise_folder(tmp_path / split, classes=4, per_class=8)
    dm = CIFAR10DataModule(root=str(tmp_path), num_workers=0, batch_size=8)
    model = SimCLR(SmallConvNet((4, 8)), projection_hidden_dim=8, projection_dim=4,
                   head_batch_norm=False)
    trainer = pl.Trainer(accelerator="cpu", limit_val_batches=1, logger=False,
                         callbacks=[KNNCallback(k=5)], enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    metrics = trainer.validate(model, datamodule=dm, verbose=False)[0]
    assert metrics["val/knn_top1"] < 100.0  # was 100.0: bank and queries all of class 0


# ------------------------------------------------------------------ train / eval sizes
def test_train_and_eval_sizes_that_differ_warn(tiny_image_folder):
    train, val = str(tiny_image_folder / "train"), str(tiny_image_folder / "test")
    dm = ImageFolderDataModule(train, val, train_transform=SimCLRViews("cifar"), **LOADER)
    state = torch.get_rng_state()
    with pytest.warns(UserWarning, match=r"Training views are 32x32 px but the evaluation "
                                         r"transform gives 224x224 px"):
        dm.setup("fit")
    assert torch.equal(state, torch.get_rng_state())  # the probe leaves the random state alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageFolderDataModule(train, val, preset="cifar", **LOADER).setup("fit")

