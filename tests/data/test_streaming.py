"""StreamingDataModule: the batches of an image folder's shards equal the ImageFolderDataModule
batches of that folder (same order, same views), for 0 and 2 loader workers and with the
batched views; the evaluation splits too. Read from a URL (litdata's ``local:`` scheme, a local
folder treated as remote), the batches are the same and a second run reuses the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("litdata")

from ssl_lightning.cli.commands import EXTRA_COMMANDS  # noqa: E402
from ssl_lightning.data import (  # noqa: E402
    DeviceViews,
    ImageFolderDataModule,
    SimCLRViews,
    StreamingDataModule,
)
from ssl_lightning.data.shard_manifest import MANIFEST  # noqa: E402
from ssl_lightning.data.shard_source import url_cache  # noqa: E402
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


def _module(root: str, cache: Path, **kwargs) -> StreamingDataModule:  # type: ignore[no-untyped-def]
    return StreamingDataModule(root, preset="cifar", batch_size=4, seed=5, cache_dir=str(cache),
                               train_transform=SimCLRViews("cifar", crop_size=16), **kwargs)


def _cached(folder: Path) -> dict[str, tuple[int, int]]:
    """Every cached file but the manifest (fetched anew at each setup): (inode, mtime)."""
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def test_url_batches_equal_the_folder_ones_and_a_second_run_reuses_the_cache(
        tiny_image_folder: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    EXTRA_COMMANDS["shard"](["--images", str(tiny_image_folder / "train"), "--output",
                             str(shards), "--shard-size", "5", "--no-progress"])
    url, cache = f"local:{shards}", tmp_path / "cache"
    direct = _batches(_module(str(shards), cache, num_workers=0))
    assert not cache.exists()  # a local folder is read in place
    _assert_same(_batches(_module(url, cache, num_workers=0)), direct)
    folder = url_cache(url, cache)
    first = _cached(folder)
    assert sorted(first) == [f"shard-0000{i}/{f}" for i in range(5)
                             for f in ("chunk-0-0.bin", "index.json")]
    _assert_same(_batches(_module(url, cache, num_workers=2)), direct)
    assert _cached(folder) == first  # no second download
    assert sorted(p.name for p in folder.iterdir())[0] == MANIFEST  # no temporary left



class _EveryWorkerReadsEverything(torch.utils.data.IterableDataset):
    """Each loader worker reads every sample of ``dataset``, in order: the first read of each
    chunk happens in all workers at once."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __iter__(self):  # type: ignore[no-untyped-def]
        worker = torch.utils.data.get_worker_info()
        for index in range(len(self.dataset)):  # type: ignore[arg-type]
            image, target = self.dataset[index]
            yield worker.id, index, image.tobytes(), target


def test_many_workers_reading_a_fresh_cache_of_tiny_chunks(tiny_image_folder: Path,
                                                           tmp_path: Path) -> None:
    """The shard-cache race: a worker that found another one's download lock read the chunk
    before it was in the cache (``FileNotFoundError: .../shard-00003/chunk-0-0.bin`` in
    litdata's ``download_bytes``). 6 workers, 12 chunks of 2 images, 3 fresh caches."""
    from torch.utils.data import DataLoader

    from ssl_lightning.data.streaming import ShardDataset

    workers, shards = 6, tmp_path / "shards"
    write_shards(tiny_image_folder / "train", shards, shard_size=2, progress=False)
    expected = [(image.tobytes(), target) for image, target in ShardDataset(shards)]
    for repeat in range(3):
        dataset = ShardDataset(f"local:{shards}", cache_dir=tmp_path / f"cache{repeat}")
        loader = DataLoader(_EveryWorkerReadsEverything(dataset), batch_size=None,
                            num_workers=workers)
        seen: dict[int, list] = {w: [None] * len(expected) for w in range(workers)}
        for worker, index, data, target in loader:
            seen[worker][index] = (data, target)
        assert all(reads == expected for reads in seen.values())
