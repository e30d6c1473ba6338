"""Hostile shard folders: the attacker writes the shards, their litdata ``index.json`` and a
manifest whose sizes and SHA-256s match. A serializer that could run code (litdata's
``pickle``) is refused before the first read, local or at a URL, also with
``verify_checksums``; a shard, file or chunk name that leaves its folder is refused before
anything is opened or written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litdata")

from ssl_lightning.data import StreamingDataModule  # noqa: E402
from ssl_lightning.data.shard_manifest import MANIFEST, ShardError, describe_shard  # noqa: E402
from ssl_lightning.data.shards import write_shards  # noqa: E402


class _Payload:
    """Unpickled, it creates the file ``marker`` (what a real payload would do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return Path.touch, (self.marker,)


def _edit_manifest(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    manifest = json.loads((root / MANIFEST).read_text())
    edit(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def shards(tmp_path: Path, tiny_image_folder: Path) -> Path:
    write_shards(tiny_image_folder / "train", tmp_path / "src" / "deep" / "shards",
                 shard_size=12, progress=False)
    return tmp_path / "src" / "deep" / "shards"


def _module(root: str, tmp_path: Path, **kwargs: Any) -> StreamingDataModule:
    return StreamingDataModule(root, preset="cifar", batch_size=4, num_workers=0,
                               cache_dir=str(tmp_path / "cache" / "dir"), **kwargs)


def _pickling_shard(root: Path, marker: Path) -> None:
    """Replace ``shard-00000`` of ``root`` by one whose path field is pickled (litdata picks
    its ``pickle`` serializer for the payload), and its manifest entry by the matching one."""
    from litdata import StreamingDataset
    from litdata.streaming.writer import BinaryWriter

    folder = root / "shard-00000"
    real = StreamingDataset(str(folder))
    items = [real[i] for i in range(len(real))]
    del real
    shutil.rmtree(folder)
    writer = BinaryWriter(str(folder), chunk_size=len(items))
    for i, (data, label, _) in enumerate(items):
        writer.add_item(i, (bytes(data), int(label), _Payload(marker)))
    writer.done()
    writer.merge(1)
    index = json.loads((folder / "index.json").read_text())
    assert index["config"]["data_format"] == ["bytes", "int", "pickle"]
    labels = [int(label) for _, label, _ in items]
    _edit_manifest(root, lambda m: m["shards"].__setitem__(0, describe_shard(folder, labels)))


@pytest.mark.parametrize("where", ["local", "url"])
def test_a_pickling_serializer_is_refused_before_the_first_read(shards: Path, tmp_path: Path,
                                                                where: str) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    _pickling_shard(shards, marker)
    root = str(shards) if where == "local" else f"local:{shards}"
    module = _module(root, tmp_path, verify_checksums=True)  # the SHA-256s match
    with pytest.raises(ShardError, match=r"shard .*shard-00000: its litdata index.json gives "
                                         r"field 2 the serializer 'pickle' \(data_format\), "
                                         r"outside the allowed \['bytes', 'int', 'str'\]"):
        module.setup("fit")
        list(module.train_dataloader())
    assert not marker.exists()


def test_a_remote_shard_named_out_of_the_cache_is_refused(shards: Path, tmp_path: Path) -> None:
    """``shards/../../ESCAPED`` exists on the store; its cache path would be outside the
    cache folder (``cache/dir/<hash>/../../ESCAPED`` = ``cache/ESCAPED``)."""
    escaped = shards / ".." / ".." / "ESCAPED"
    escaped.mkdir()
    shutil.copy(shards / "shard-00000" / "index.json", escaped / "index.json")
    _edit_manifest(shards, lambda m: m["shards"][0].update(name="../../ESCAPED"))
    with pytest.raises(ShardError, match=r"its shard '../../ESCAPED' is not a plain file name"):
        _module(f"local:{shards}", tmp_path).setup("fit")
    assert not (tmp_path / "cache" / "ESCAPED").exists()
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()) == [MANIFEST]


@pytest.mark.parametrize("where", ["local", "url"])
def test_a_chunk_named_out_of_its_shard_is_refused(shards: Path, tmp_path: Path,
                                                   where: str) -> None:
    """litdata would download (or read) ``<shard>/../../../CHUNK_ESCAPED.bin``."""
    bad = "../../../CHUNK_ESCAPED.bin"
    folder = shards / "shard-00000"
    shutil.copy(folder / "chunk-0-0.bin", folder / bad)  # there on the store
    index = json.loads((folder / "index.json").read_text())
    index["chunks"][0]["filename"] = bad
    (folder / "index.json").write_text(json.dumps(index))

    def edit(manifest: dict) -> None:
        entry = manifest["shards"][0]
        entry["files"] = {bad: entry["files"]["chunk-0-0.bin"],
                          "index.json": describe_shard(folder, entry["labels"])["files"][
                              "index.json"]}

    _edit_manifest(shards, edit)
    module = _module(str(shards) if where == "local" else f"local:{shards}", tmp_path)
    with pytest.raises(ShardError, match=r"its file of shard 'shard-00000' "
                                         r"'../../../CHUNK_ESCAPED.bin' is not a plain file name"):
        module.setup("fit")
        list(module.train_dataloader())
    assert not (tmp_path / "cache" / "CHUNK_ESCAPED.bin").exists()
    assert not list((tmp_path).rglob("cache/**/CHUNK_ESCAPED.bin"))


def test_a_chunk_named_out_of_its_shard_by_the_index_alone_is_refused(shards: Path,
                                                                     tmp_path: Path) -> None:
    """The manifest is honest, litdata's index names another chunk: refused as well."""
    folder = shards / "shard-00000"
    index = json.loads((folder / "index.json").read_text())
    index["chunks"][0]["filename"] = "../../../CHUNK_ESCAPED.bin"
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match=r"its chunk file '../../../CHUNK_ESCAPED.bin' is not a "
                                         "plain file name"):
        _module(f"local:{shards}", tmp_path).setup("fit")


def test_an_index_changed_after_setup_is_refused_when_a_process_opens_the_shard(
        shards: Path, tmp_path: Path) -> None:
    from ssl_lightning.data.streaming import ShardDataset

    marker = tmp_path / "PAYLOAD_RAN"
    dataset = ShardDataset(shards)  # checked here: fine
    good = (shards / "shard-00001" / "index.json").read_text()
    _pickling_shard(shards, marker)  # then replaced, as a loader worker starts
    with pytest.raises(ShardError, match=r"shard-00000: its litdata index.json gives field 2 "
                                         r"the serializer 'pickle'"):
        dataset[0]
    assert not marker.exists()
    assert (shards / "shard-00001" / "index.json").read_text() == good
    dataset[12]  # the other shard reads
