"""Bad shards stop at setup with an error naming the shard; a sample that cannot be decoded
follows the image loader's skip policy, with the same replacement as the image folder. At a URL
(litdata's ``local:`` scheme), every error names the shard's URL."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("litdata")

from ssl_lightning.data import (  # noqa: E402
    CorruptImageError,
    ImageFolderDataModule,
    SimCLRViews,
    StreamingDataModule,
)
from ssl_lightning.data.shard_manifest import MANIFEST, ShardError  # noqa: E402
from ssl_lightning.data.shard_source import url_cache  # noqa: E402
from ssl_lightning.data.shards import write_shards  # noqa: E402


@pytest.fixture
def shards(tmp_path: Path, tiny_image_folder: Path) -> Path:
    write_shards(tiny_image_folder / "train", tmp_path / "shards", shard_size=5, progress=False)
    return tmp_path / "shards"


def _setup(root: Path, **kwargs) -> StreamingDataModule:  # type: ignore[no-untyped-def]
    module = StreamingDataModule(str(root), preset="cifar", batch_size=4, num_workers=0,
                                 **kwargs)
    module.setup("fit")
    return module


def _remote(root: Path, cache: Path, **kwargs) -> StreamingDataModule:  # type: ignore[no-untyped-def]
    return StreamingDataModule(f"local:{root}", preset="cifar", batch_size=4, num_workers=0,
                               cache_dir=str(cache), **kwargs)


def _edit_manifest(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    manifest = json.loads((root / MANIFEST).read_text())
    edit(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


def test_truncated_shard(shards: Path) -> None:
    chunk = shards / "shard-00001" / "chunk-0-0.bin"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(ShardError, match=r"shard shard-00001 is truncated: chunk-0-0.bin has "
                                         r"\d+ bytes, the manifest \d+\. Rerun `python -m "
                                         r"ssl_lightning shard --images .*train --output"):
        _setup(shards)


def test_missing_shard(shards: Path) -> None:
    shutil.rmtree(shards / "shard-00003")
    with pytest.raises(ShardError, match="shard shard-00003 is missing"):
        _setup(shards)


def test_manifest_of_another_folder(shards: Path) -> None:
    _edit_manifest(shards, lambda m: m["shards"][2].update(count=4, labels=[0] * 4))
    with pytest.raises(ShardError, match="lists 23 images in its shards but num_images=24"):
        _setup(shards)
    _edit_manifest(shards, lambda m: m.update(num_images=23))
    with pytest.raises(ShardError, match="shard shard-00002 holds 5 samples, the manifest says 4"):
        _setup(shards)


def test_changed_bytes_of_the_same_size_with_verify_checksums(shards: Path) -> None:
    chunk = shards / "shard-00004" / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    _setup(shards)  # sizes and index agree: only the checksum sees it
    with pytest.raises(ShardError, match="shard shard-00004: the SHA-256 of chunk-0-0.bin"):
        _setup(shards, verify_checksums=True)


def test_unfinished_shard_folder(shards: Path) -> None:
    _edit_manifest(shards, lambda m: m.update(complete=False))
    with pytest.raises(ShardError, match="unfinished .*Rerun `python -m ssl_lightning shard"):
        _setup(shards)
    with pytest.raises(FileNotFoundError, match="not a shard folder. Make one with"):
        _setup(shards.parent)
    with pytest.raises(ShardError, match=r"unfinished .*upload FOLDER to local:/"):
        _remote(shards, shards.parent / "cache").setup("fit")
    with pytest.raises(FileNotFoundError, match=r"No shard manifest at local:/.*manifest.json "
                                                r"\(cannot fetch"):
        _remote(shards.parent, shards.parent / "cache").setup("fit")


def test_corrupt_sample_follows_the_skip_policy_of_the_image_folder(tmp_path: Path,
                                                                    make_image_folder) -> None:
    images = make_image_folder(tmp_path / "images", classes=2, per_class=12)
    bad = sorted((images / "class_1").glob("*.jpg"))[3]
    bad.write_bytes(b"not a jpeg")
    write_shards(images, tmp_path / "shards", shard_size=7, progress=False)
    common = dict(preset="cifar", batch_size=4, num_workers=0, seed=1, on_error="skip",
                  max_corrupt_fraction=0.1, train_transform=SimCLRViews("cifar", crop_size=16))
    stream = StreamingDataModule(str(tmp_path / "shards"), **common)
    folder = ImageFolderDataModule(str(images), **common)
    with pytest.warns(UserWarning, match=r"Cannot decode image .*shards/shard-0000\d#\d \(from "
                                         r"class_1/.*\.jpg: UnidentifiedImageError\)"):
        batches = [list(module.train_dataloader()) for module in (stream, folder)]
    for (views_s, y_s, seeds_s), (views_f, y_f, seeds_f) in zip(*batches, strict=True):
        assert torch.equal(y_s, y_f) and torch.equal(seeds_s, seeds_f)
        assert all(torch.equal(a, b) for a, b in zip(views_s, views_f, strict=True))

    strict = StreamingDataModule(str(tmp_path / "shards"), **{**common, "on_error": "raise"})
    with pytest.raises(CorruptImageError, match=r"shard-0000\d#\d \(from class_1/"):
        list(strict.train_dataloader())
    few = StreamingDataModule(str(tmp_path / "shards"), **{**common, "max_corrupt_fraction": 0})
    with pytest.raises(CorruptImageError, match="more than max_corrupt_fraction=0"):
        list(few.train_dataloader())


def test_a_bad_remote_shard_is_named_by_its_url(shards: Path, tmp_path: Path) -> None:
    url, cache = f"local:{shards}", tmp_path / "cache"
    shutil.rmtree(shards / "shard-00003")
    with pytest.raises(ShardError, match=rf"Shard folder {url}: shard {url}/shard-00003 is "
                                         r"missing \(cannot fetch .*shard-00003/index.json.*"
                                         r"upload FOLDER to "):
        _remote(shards, cache).setup("fit")

    manifest = json.loads((shards / MANIFEST).read_text())
    manifest["shards"][2].update(count=4, labels=[0] * 4)
    manifest["num_images"] = 23
    (shards / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=rf"{url}/manifest.json changed since the cache .* was "
                                         "filled"):
        _remote(shards, cache).setup("fit")  # the cache holds the first manifest
    with pytest.raises(ShardError, match=rf"shard {url}/shard-00002 holds 5 samples, the "
                                         "manifest says 4"):
        _remote(shards, tmp_path / "cache2").setup("fit")


def test_a_remote_chunk_truncated_or_changed_after_its_index(shards: Path,
                                                              tmp_path: Path) -> None:
    url, cache = f"local:{shards}", tmp_path / "cache"
    chunk = shards / "shard-00001" / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"shard {url}/shard-00001: the SHA-256 of "
                                         "chunk-0-0.bin differs"):
        _remote(shards, tmp_path / "cache_sha", verify_checksums=True).setup("fit")

    module = _remote(shards, cache)
    module.setup("fit")  # the index and the manifest agree: chunks are fetched when opened
    with pytest.raises(ShardError, match=rf"shard {url}/shard-00001 is damaged: the downloaded "
                                         "chunk-0-0.bin has another SHA-256 than the "
                                         r"manifest's\. Upload the shard again"):
        list(module.train_dataloader())
    chunk.write_bytes(bytes(data[:-300]))
    with pytest.raises(ShardError, match=rf"shard {url}/shard-00001 is damaged: the downloaded "
                                         r"chunk-0-0.bin has \d+ bytes, the manifest \d+"):
        list(module.train_dataloader())
    assert not (url_cache(url, cache) / "shard-00001" / "chunk-0-0.bin").exists()  # not kept


def test_damaged_images_in_a_cached_chunk_are_refused_naming_the_cache_folder(
        shards: Path, tmp_path: Path) -> None:
    """A cached chunk changed after its download (31 of 32 damaged images decoded silently)."""
    url, cache = f"local:{shards}", tmp_path / "cache"
    module = _remote(shards, cache)
    module.setup("fit")
    list(module.train_dataloader())  # fills the cache
    cached = url_cache(url, cache) / "shard-00002" / "chunk-0-0.bin"
    data = bytearray(cached.read_bytes())
    for offset in range(len(data) // 2, len(data) - 8, 97):  # inside the images' bytes
        data[offset] ^= 0x55
    cached.write_bytes(bytes(data))
    again = _remote(shards, cache)
    again.setup("fit")
    with pytest.raises(ShardError, match=rf"shard {url}/shard-00002 is damaged: the cached copy "
                                         rf".*chunk-0-0.bin has another SHA-256 than the "
                                         rf"manifest's\. Delete the local cache folder "
                                         rf"{url_cache(url, cache)} "):
        list(again.train_dataloader())


def test_a_damaged_chunk_litdata_cannot_read_is_one_line_naming_shard_and_chunk(
        shards: Path) -> None:
    chunk = shards / "shard-00003" / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    data[:48] = b"\xff" * 48  # the chunk's table of item offsets
    chunk.write_bytes(bytes(data))
    module = _setup(shards)  # sizes agree: found when read
    with pytest.raises(ShardError, match=r"shard .*shards/shard-00003 cannot be read: its chunk "
                                         r"chunk-0-0.bin in .*shard-00003 is damaged \(\w+: "
                                         r".*\)\. Rerun `python -m ssl_lightning shard --images "):
        list(module.train_dataloader())


def test_a_file_another_process_is_downloading_is_waited_for(shards: Path,
                                                             tmp_path: Path) -> None:
    """Another DDP rank on the node holds litdata's lock on a file: its copy is used."""
    from filelock import FileLock

    from ssl_lightning.data.shard_source import RemoteShards

    remote = RemoteShards(f"local:{shards}", tmp_path / "cache")
    local = remote.cache / "shard-00000" / "chunk-0-0.bin"
    local.parent.mkdir(parents=True)
    lock = FileLock(f"{local}.lock", thread_local=False)  # released by the timer thread
    lock.acquire()

    def finish() -> None:
        shutil.copy(shards / "shard-00000" / "chunk-0-0.bin", local)
        lock.release()

    timer = threading.Timer(0.3, finish)
    timer.start()
    assert remote.fetch("shard-00000/chunk-0-0.bin").read_bytes() == \
        (shards / "shard-00000" / "chunk-0-0.bin").read_bytes()
    timer.join()
