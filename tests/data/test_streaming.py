"""StreamingDataModule: the batches of an image folder's shards equal the ImageFolderDataModule
batches of that folder (same order, same views), for 0 and 2 loader workers and with the
batched views; the evaluation splits too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litdata")

from ssl_lightning.data import (  # noqa: E402
    DeviceViews,
    ImageFolderDataModule,
    SimCLRViews,
    StreamingDataModule,
)
from ssl_lightning.data.shards import write_shards  # noqa: E402


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_image_folder):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("streaming")
    for split in ("train", "test"):
        write_shards(tiny_image_folder / split, root / split, shard_size=5, progress=False)
    return root


def _batches(module, epochs: int = 2) -> list:  # type: ignore[no-untyped-def]
    module.setup("fit")
    loader = module.train_dataloader()
    out = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        out += list(loader)
    return out


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (views_a, targets_a, seeds_a), (views_b, targets_b, seeds_b) in zip(a, b, strict=True):
        assert torch.equal(targets_a, targets_b) and torch.equal(seeds_a, seeds_b)
        for va, vb in zip(views_a, views_b, strict=True):
            assert torch.equal(va, vb)


@pytest.mark.parametrize("batched", [False, True], ids=["per_image", "batched_views"])
def test_shards_give_the_image_folder_batches_for_any_worker_count(shards, tiny_image_folder,
                                                                   batched) -> None:
    def kwargs(workers: int) -> dict:
        views = dict(device_transform=DeviceViews("cifar", crop_size=16)) if batched else dict(
            train_transform=SimCLRViews("cifar", crop_size=16))
        return dict(preset="cifar", batch_size=4, seed=5, num_workers=workers, **views)

    folder = _batches(ImageFolderDataModule(str(tiny_image_folder / "train"), **kwargs(0)))
    _assert_same(_batches(StreamingDataModule(str(shards / "train"), **kwargs(0))), folder)
    _assert_same(_batches(StreamingDataModule(str(shards / "train"), **kwargs(2))), folder)


@pytest.mark.parametrize("train_labeled", [None, False])
def test_evaluation_splits_equal_the_image_folder_ones(shards, tiny_image_folder,
                                                       train_labeled) -> None:
    common = dict(preset="cifar", batch_size=4, num_workers=0, train_labeled=train_labeled)
    stream = StreamingDataModule(str(shards / "train"), str(shards / "test"), **common)
    folder = ImageFolderDataModule(str(tiny_image_folder / "train"),
                                   str(tiny_image_folder / "test"), **common)
    assert stream.num_classes == folder.num_classes == 2
    for module in (stream, folder):
        module.setup("validate")
    for loader_s, loader_f in zip(stream.val_dataloader(), folder.val_dataloader(), strict=True):
        for (x_s, y_s), (x_f, y_f) in zip(loader_s, loader_f, strict=True):
            assert torch.equal(x_s, x_f) and torch.equal(y_s, y_f)
