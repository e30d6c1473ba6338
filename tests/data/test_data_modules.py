"""Data modules: batch layout, the validation loader pair, layouts, subsets and bad inputs."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torchvision import datasets

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    CorruptImageError,
    ImageFolderDataModule,
    SimCLRViews,
)

LOADER = {"num_workers": 0, "batch_size": 4}


def _labels(loader) -> list[int]:
    return [int(t) for _, targets in loader for t in targets]


def test_cifar_folder_layout_batches_and_val_pair(tiny_image_folder: Path) -> None:
    dm = CIFAR10DataModule(root=str(tiny_image_folder), **LOADER)
    assert dm.layout() == "folder" and dm.num_classes == 10
    dm.setup("fit")
    views, targets, _ = next(iter(dm.train_dataloader()))
    assert isinstance(views, list) and len(views) == 2
    assert all(v.shape == (4, 3, 32, 32) and v.dtype == torch.float32 for v in views)
    assert targets.dtype == torch.long and set(targets.tolist()) <= {0, 1}
    assert len(dm.train_dataloader()) == 6  # 24 images, drop_last
    bank, queries = dm.val_dataloader()
    images, labels = next(iter(queries))
    assert images.shape == (4, 3, 32, 32)
    assert sorted(_labels(bank)) == [0] * 12 + [1] * 12  # nothing dropped
    assert sorted(_labels(queries)) == [0] * 6 + [1] * 6
    assert all(set(t.tolist()) == {0, 1} for _, t in bank)  # class-balanced order


def test_eval_loaders_are_deterministic(tiny_image_folder: Path) -> None:
    dm = CIFAR10DataModule(root=str(tiny_image_folder), **LOADER)
    dm.setup("validate")
    first = torch.cat([x for x, _ in dm.val_dataloader()[1]])
    second = torch.cat([x for x, _ in dm.val_dataloader()[1]])
    assert torch.equal(first, second)


def test_knn_train_subset_is_a_fixed_subset(tiny_image_folder: Path) -> None:
    banks = []
    for _ in range(2):
        dm = CIFAR10DataModule(root=str(tiny_image_folder), knn_train_subset=7, **LOADER)
        dm.setup("fit")
        banks.append(dm.eval_datasets[0])
    assert len(banks[0]) == 7 and list(banks[0].indices) == list(banks[1].indices)
    assert len(set(banks[0].indices)) == 7 and sorted(banks[0].indices) == banks[0].indices
    assert len(dm.eval_datasets[1]) == 12  # queries are never subsampled


def test_batch_larger_than_dataset_with_drop_last(tiny_image_folder: Path) -> None:
    dm = CIFAR10DataModule(root=str(tiny_image_folder), batch_size=32, num_workers=0)
    with pytest.raises(ValueError, match=r"batch_size=32 .* than the 24 training images"):
        dm.setup("fit")
    dm = CIFAR10DataModule(root=str(tiny_image_folder), batch_size=16, num_workers=0)
    dm.trainer = SimpleNamespace(world_size=2)  # 24 images over 2 devices: 12 per device
    with pytest.raises(ValueError, match=r"batch_size=16 .*24 training images split over 2 "
                                         r"devices \(12 each\)"):
        dm.setup("fit")
    dm = CIFAR10DataModule(root=str(tiny_image_folder), batch_size=32, num_workers=0,
                           drop_last=False)
    dm.setup("fit")
    assert len(dm.train_dataloader()) == 1


def test_cifar_missing_data_explains_both_layouts(tmp_path: Path) -> None:
    dm = CIFAR10DataModule(root=str(tmp_path / "cifar10"), **LOADER)
    pattern = (r"CIFAR-10 not found under .*cifar10: expected either an ImageFolder copy "
               r".*train/<class>/\*\.jpg .*cifar-10-batches-py\. Get it with archive: PATH")
    with pytest.raises(FileNotFoundError, match=pattern):
        dm.setup("fit")
    assert CIFAR100DataModule().root == Path("data/cifar100")
    with pytest.raises(FileNotFoundError, match="CIFAR-100 not found .*cifar-100-python"):
        CIFAR100DataModule(root=str(tmp_path)).setup("fit")


def test_cifar_torchvision_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A miniature cifar-10-batches-py in torchvision's pickle format (md5 check bypassed).
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        batch = {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                 "labels": [i % 10, 1, 2, 3]}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": [f"c{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    monkeypatch.setattr(datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    dm = CIFAR10DataModule(root=str(tmp_path), **LOADER)
    assert dm.layout() == "torchvision"
    dm.setup("fit")
    assert len(dm.train_dataset) == 20 and len(dm.eval_datasets[1]) == 4
    views, targets, _ = next(iter(dm.train_dataloader()))
    assert [v.shape for v in views] == [(4, 3, 32, 32)] * 2
    assert sorted(_labels(dm.val_dataloader()[1])) == [1, 2, 3, 5]


def test_image_folder_labeled_train_and_val(tiny_image_folder: Path) -> None:
    dm = ImageFolderDataModule(str(tiny_image_folder / "train"), str(tiny_image_folder / "test"),
                               preset="cifar", **LOADER)
    assert dm.num_classes == 2
    dm.setup("fit")
    bank, queries = dm.val_dataloader()
    assert len(bank.dataset) == 24 and len(queries.dataset) == 12


def test_image_folder_unlabeled_train_uses_split_val(
    tmp_path: Path, tiny_image_folder: Path, make_image_folder
) -> None:
    flat = make_image_folder(tmp_path, classes=1, per_class=10) / "class_0"
    dm = ImageFolderDataModule(str(flat), str(tiny_image_folder / "test"), preset="cifar",
                               **LOADER)
    dm.setup("fit")
    _, targets, _ = next(iter(dm.train_dataloader()))
    assert targets.tolist() == [-1] * 4
    bank, queries = dm.eval_datasets
    assert set(bank.indices).isdisjoint(queries.indices)
    assert sorted([*bank.indices, *queries.indices]) == list(range(12))
    assert sorted(_labels(dm.val_dataloader()[0])) == [0, 0, 0, 1, 1, 1]  # both halves: each class
    assert sorted(_labels(dm.val_dataloader()[1])) == [0, 0, 0, 1, 1, 1]
    assert dm.num_classes == 2


def test_image_folder_without_labels_has_no_validation(tmp_path: Path, make_image_folder) -> None:
    flat = make_image_folder(tmp_path, classes=1, per_class=10) / "class_0"
    dm = ImageFolderDataModule(str(flat), preset="cifar", **LOADER)
    dm.setup("fit")
    assert dm.val_dataloader() == [] and dm.num_classes is None


def test_image_folder_missing_train_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'missing'} does not exist"):
        ImageFolderDataModule(str(tmp_path / "missing"), **LOADER).setup("fit")


def test_corrupt_image_surfaces_through_worker_processes(
    tmp_path: Path, make_image_folder
) -> None:
    root = make_image_folder(tmp_path, classes=1, per_class=4) / "class_0"
    (root / "002.jpg").write_bytes(b"\xff\xd8 broken")
    dm = ImageFolderDataModule(str(root), preset="cifar", batch_size=4, num_workers=1,
                               persistent_workers=True, prefetch_factor=1, on_error="raise")
    dm.setup("fit")
    with pytest.raises(CorruptImageError, match=r"^Cannot read image file \S*002.jpg[^\n]*$"):
        next(iter(dm.train_dataloader()))


def test_multi_size_views_collate_per_position(tiny_image_folder: Path) -> None:
    from ssl_lightning.data import MultiViewTransform

    big, small = SimCLRViews("cifar", num_views=1), SimCLRViews("cifar", 1, crop_size=16)
    transform = MultiViewTransform([*big.transforms, *small.transforms, *small.transforms])
    dm = CIFAR10DataModule(root=str(tiny_image_folder), train_transform=transform, **LOADER)
    dm.setup("fit")
    views, *_ = next(iter(dm.train_dataloader()))
    assert [tuple(v.shape) for v in views] == [(4, 3, 32, 32), (4, 3, 16, 16), (4, 3, 16, 16)]


def _tiny_simclr() -> SimCLR:
    return SimCLR(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                  head_batch_norm=False, optimizer="sgd", lr=0.1, lr_scaling="none",
                  warmup_epochs=0)


@pytest.mark.parametrize("with_val", [False, True])
def test_fit_on_unlabeled_data_with_and_without_val(
    tmp_path: Path, tiny_image_folder: Path, make_image_folder, with_val: bool
) -> None:
    flat = make_image_folder(tmp_path / "unlabeled", classes=1, per_class=8) / "class_0"
    val_dir = str(tiny_image_folder / "test") if with_val else None
    dm = ImageFolderDataModule(str(flat), val_dir, preset="cifar", **LOADER)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path, enable_model_summary=False)
    trainer.fit(_tiny_simclr(), datamodule=dm)
    assert trainer.global_step == 2
    assert list(trainer.num_val_batches) == ([2, 2] if with_val else [0])  # 6 + 6, batch 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"batch_size": 0}, "batch_size must be > 0, got 0"),
     ({"num_workers": -1}, "num_workers must be >= 0, got -1"),
     ({"knn_train_subset": 0}, "knn_train_subset must be > 0, got 0")],
)
def test_bad_loader_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CIFAR10DataModule(**kwargs)
