"""The shard command: every image's bytes and label once, in ImageFolder order, a manifest
with counts, classes, bytes and checksums, and a resumed run that keeps the verified shards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("litdata")
from litdata import StreamingDataset  # noqa: E402

from ssl_lightning.cli.commands import EXTRA_COMMANDS  # noqa: E402
from ssl_lightning.data import ImageFolderDataset  # noqa: E402
from ssl_lightning.data.shard_manifest import MANIFEST, file_sha256  # noqa: E402
from ssl_lightning.data.shards import write_shards  # noqa: E402


def _read_all(output: Path, manifest: dict) -> list[tuple[bytes, int, str]]:
    items = []
    for entry in manifest["shards"]:
        shard = StreamingDataset(str(output / entry["name"]))
        items += [(bytes(data), int(label), path) for data, label, path in
                  (shard[i] for i in range(len(shard)))]
    return items


def test_shards_hold_every_image_and_label_in_image_folder_order(tmp_path, tiny_image_folder):
    source = tiny_image_folder / "train"
    manifest = EXTRA_COMMANDS["shard"](["--images", str(source), "--output",
                                        str(tmp_path / "out"), "--shard-size", "5",
                                        "--no-progress"])
    folder = ImageFolderDataset(source)
    items = _read_all(tmp_path / "out", manifest)
    assert [(Path(p).read_bytes(), t) for p, t in folder.samples] == [(d, t) for d, t, _ in items]
    assert [str(source / p) for _, _, p in items] == [p for p, _ in folder.samples]
    assert manifest["classes"] == folder.classes and manifest["num_images"] == 24
    assert manifest["complete"] and [e["count"] for e in manifest["shards"]] == [5] * 4 + [4]
    entry = manifest["shards"][1]
    assert entry["labels"] == [t for _, t in folder.samples[5:10]]
    chunk = tmp_path / "out" / entry["name"] / "chunk-0-0.bin"
    assert entry["files"]["chunk-0-0.bin"] == {"bytes": chunk.stat().st_size,
                                               "sha256": file_sha256(chunk)}
    assert manifest["bytes"] == sum(e["bytes"] for e in manifest["shards"])
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == manifest


def test_flat_folder_is_unlabeled(tmp_path, make_image_folder):
    source = make_image_folder(tmp_path / "one_class", classes=1, per_class=3)
    manifest = write_shards(source, tmp_path / "out", progress=False)
    assert manifest["classes"] == [] and manifest["shards"][0]["labels"] == [-1] * 3


def test_interrupted_run_resumes_keeping_verified_shards(tmp_path, tiny_image_folder,
                                                         monkeypatch):
    import ssl_lightning.data.shards as shards

    out, source = tmp_path / "out", tiny_image_folder / "train"
    original, calls = shards._write_shard, []

    def interrupted(images, output, number, samples):  # type: ignore[no-untyped-def]
        if number == 3:
            raise KeyboardInterrupt
        calls.append(number)
        return original(images, output, number, samples)

    monkeypatch.setattr(shards, "_write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_shards(source, out, shard_size=5, progress=False)
    partial = json.loads((out / MANIFEST).read_text())
    assert not partial["complete"] and len(partial["shards"]) == 3
    kept = {n: (out / f"shard-0000{n}" / "chunk-0-0.bin").stat().st_mtime_ns for n in range(3)}
    (out / "shard-00001" / "chunk-0-0.bin").write_bytes(b"damaged")  # rewritten on resume

    calls.clear()
    monkeypatch.setattr(shards, "_write_shard", lambda *a: (calls.append(a[2]), original(*a))[1])
    resumed = write_shards(source, out, shard_size=5, progress=False)
    assert calls == [1, 3, 4]  # shards 0 and 2 verified and kept
    assert (out / "shard-00000" / "chunk-0-0.bin").stat().st_mtime_ns == kept[0]
    fresh = write_shards(source, tmp_path / "fresh", shard_size=5, progress=False)
    assert _read_all(out, resumed) == _read_all(tmp_path / "fresh", fresh)
    chunks = lambda m: [e["files"]["chunk-0-0.bin"] for e in m["shards"]]  # noqa: E731
    assert chunks(resumed) == chunks(fresh)  # (litdata's index.json names its folder)


def test_refuses_a_folder_of_other_files_or_another_layout(tmp_path, tiny_image_folder):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files and no manifest.json"):
        write_shards(tiny_image_folder / "train", other, progress=False)
    assert (other / "notes.txt").read_text() == "mine"
    write_shards(tiny_image_folder / "train", tmp_path / "out", shard_size=5, progress=False)
    with pytest.raises(ValueError, match="shard_size: 5 there, 7 now"):
        write_shards(tiny_image_folder / "train", tmp_path / "out", shard_size=7, progress=False)


def test_killed_after_the_first_shard_is_renamed_the_same_command_resumes(
        tmp_path, tiny_image_folder, monkeypatch):
    """Killed while the first manifest listing a shard is written (the shard already renamed
    into place): the folder is not refused as "holds files and no manifest.json"."""
    import ssl_lightning.data.shards as shards

    out, source = tmp_path / "out", tiny_image_folder / "train"
    original = shards._write_manifest

    def killed(output, manifest):  # type: ignore[no-untyped-def]
        if manifest["shards"]:
            raise KeyboardInterrupt
        original(output, manifest)

    monkeypatch.setattr(shards, "_write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        write_shards(source, out, shard_size=5, progress=False)
    assert (out / "shard-00000").is_dir()
    monkeypatch.setattr(shards, "_write_manifest", original)
    resumed = write_shards(source, out, shard_size=5, progress=False)
    fresh = write_shards(source, tmp_path / "fresh", shard_size=5, progress=False)
    assert resumed["complete"] and _read_all(out, resumed) == _read_all(tmp_path / "fresh", fresh)


def _run_shard(args: list[str], capsys) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as stop:
        EXTRA_COMMANDS["shard"]([*args, "--no-progress"])
    return stop.value.code, capsys.readouterr().err


def test_a_full_disk_removes_the_partial_shard_and_names_it(tmp_path, tiny_image_folder,
                                                            monkeypatch, capsys):
    import errno

    from litdata.streaming.writer import BinaryWriter

    out, original = tmp_path / "out", BinaryWriter.add_item

    def full(self, index, items):  # type: ignore[no-untyped-def]
        if "shard-00001" in str(self._cache_dir) and index == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, index, items)

    monkeypatch.setattr(BinaryWriter, "add_item", full)
    code, err = _run_shard(["--images", str(tiny_image_folder / "train"), "--output", str(out),
                            "--shard-size", "5"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert re.fullmatch(rf"error: OSError: Cannot write shard 1 to {re.escape(str(out))}/"
                        r"\.shard-00001\.\w+\.tmp: No space left on device; the partial shard "
                        r"was removed\. Free space .* rerun the same command to resume\.\n", err)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "shard-00000"]  # nothing partial
    monkeypatch.setattr(BinaryWriter, "add_item", original)
    assert write_shards(tiny_image_folder / "train", out, shard_size=5, progress=False)["complete"]


def test_every_mistake_is_one_error_line_with_exit_2(tmp_path, tiny_image_folder, capsys,
                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    images = str(tiny_image_folder / "train")
    cases = {
        "missing": (["--images", "nowhere", "--output", "o1"], "Data directory nowhere does "
                                                                "not exist"),
        "empty": (["--images", "empty", "--output", "o2"], "No images found under empty"),
        "taken": (["--images", images, "--output", "taken"], "holds files and no manifest"),
        "size 0": (["--images", images, "--output", "o3", "--shard-size", "0"],
                   "--shard-size must be >= 1, got 0"),
        "url": (["--images", images, "--output", "s3://bucket/x"],
                "--output s3://bucket/x: the shard command writes a local folder, not a URL. "
                "Write it locally (--output FOLDER) and upload FOLDER"),
    }
    for name, (args, expected) in cases.items():
        code, err = _run_shard(args, capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (name, err)
        assert expected in err, (name, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "taken"]  # no ./s3:/bucket/x
