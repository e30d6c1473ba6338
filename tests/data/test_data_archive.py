"""CIFAR10DataModule obtains its data from an archive: extracted once into ``root`` through a
temporary folder beside it, refusing hostile members, never leaving a half ``root``."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from ssl_lightning.data import CIFAR10DataModule

LOADER = {"batch_size": 4, "num_workers": 0}


def _tar(tiny_image_folder: Path, archive: Path, top: str = "cifar10") -> Path:
    """``archive`` (.tar.gz) of ``top/{train,test}/<class>/*.jpg``."""
    with tarfile.open(archive, "w:gz") as tar:
        for split in ("train", "test"):
            tar.add(tiny_image_folder / split, arcname=f"{top}/{split}")
    return archive


def _add_file(tar: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _module(tmp_path: Path, archive: Path | None) -> CIFAR10DataModule:
    return CIFAR10DataModule(root=str(tmp_path / "data" / "cifar10"),
                             archive=None if archive is None else str(archive), **LOADER)


def test_archive_is_extracted_into_root(tmp_path: Path, tiny_image_folder: Path) -> None:
    dm = _module(tmp_path, _tar(tiny_image_folder, tmp_path / "c.tar.gz"))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.layout() == "folder" and len(dm.train_dataset) == 24
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["cifar10"]  # no leftovers


def test_zip_and_top_level_layout(tmp_path: Path, tiny_image_folder: Path) -> None:
    archive = tmp_path / "c.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in sorted(tiny_image_folder.rglob("*.jpg")):
            zipped.write(path, path.relative_to(tiny_image_folder).as_posix())
    dm = _module(tmp_path, archive)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.eval_datasets[1]) == 12


def test_already_extracted_is_not_extracted_again(tmp_path: Path, tiny_image_folder: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dm = _module(tmp_path, _tar(tiny_image_folder, tmp_path / "c.tar.gz"))
    dm.prepare_data()
    marker = dm.root / "train" / "kept.txt"
    marker.write_text("mine")

    def no_open(*args: object, **kwargs: object) -> None:
        raise AssertionError("the archive was opened again")

    monkeypatch.setattr(tarfile, "open", no_open)
    _module(tmp_path, tmp_path / "c.tar.gz").prepare_data()
    assert marker.read_text() == "mine"


@pytest.mark.parametrize("member, problem", [
    ("cifar10/../../evil.jpg", "has a '..' component"),
    ("/tmp/ssl_lightning_evil.jpg", "is an absolute path"),
    ("cifar10/link", "is a link or a device"),
])
def test_hostile_member_is_refused(tmp_path: Path, tiny_image_folder: Path, member: str,
                                   problem: str) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(tiny_image_folder / "train", arcname="cifar10/train")
        tar.add(tiny_image_folder / "test", arcname="cifar10/test")
        if member.endswith("link"):
            info = tarfile.TarInfo(member)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            _add_file(tar, member)
    dm = _module(tmp_path, archive)
    with pytest.raises(ValueError, match=rf"member {member!r} {problem}.*; refusing to extract it"):
        dm.prepare_data()
    assert not dm.root.exists() and not (tmp_path / "evil.jpg").exists()
    assert list((tmp_path / "data").iterdir()) == []


def test_interrupted_extraction_leaves_no_root(tmp_path: Path, tiny_image_folder: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _tar(tiny_image_folder, tmp_path / "c.tar.gz")
    original = tarfile.TarFile.extractall

    def interrupted(self: tarfile.TarFile, path: str, **kwargs: object) -> None:
        self.extract(self.getmembers()[3], path, filter="data")  # a few files, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", interrupted)
    dm = _module(tmp_path, archive)
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    assert list((tmp_path / "data").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="call prepare_data"):
        dm.setup("fit")

    # A process killed mid-extraction leaves its temporary folder: it is not data, it is kept.
    monkeypatch.setattr(tarfile.TarFile, "extractall", original)
    killed = tmp_path / "data" / ".cifar10.extracting-killed" / "cifar10" / "train"
    killed.mkdir(parents=True)
    with pytest.warns(UserWarning, match="interrupted extraction"):
        dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_dataset) == 24 and killed.is_dir()


def test_archive_without_data_and_non_empty_root(tmp_path: Path) -> None:
    archive = tmp_path / "other.tar"
    with tarfile.open(archive, "w") as tar:
        _add_file(tar, "photos/a.jpg")
    dm = _module(tmp_path, archive)
    with pytest.raises(ValueError, match=r"holds no CIFAR-10 \(its top level: \['photos'\]\)"):
        dm.prepare_data()
    assert list((tmp_path / "data").iterdir()) == []
    dm.root.mkdir()
    (dm.root / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty but holds no CIFAR-10"):
        dm.prepare_data()
    with pytest.raises(FileNotFoundError, match="archive .*missing.tar.gz does not exist"):
        _module(tmp_path, tmp_path / "missing.tar.gz").prepare_data()
    (tmp_path / "plain.txt").write_text("not an archive")
    with pytest.raises(ValueError, match="is neither a tar nor a zip file"):
        _module(tmp_path / "b", tmp_path / "plain.txt").prepare_data()


def test_no_data_names_the_three_ways(tmp_path: Path) -> None:
    dm = _module(tmp_path, None)
    pattern = (r"CIFAR-10 not found under .*cifar10: expected either an ImageFolder copy .*"
               r"Get it with archive: PATH \(--data.archive, .*\), a root that holds it, or set "
               r"download: true\.$")
    with pytest.raises(FileNotFoundError, match=pattern):
        dm.prepare_data()
    with pytest.raises(FileNotFoundError, match=pattern):
        dm.setup("fit")


def test_an_archive_expanding_past_the_limits_is_refused_before_writing(
        tmp_path: Path, tiny_image_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zip bomb (a few KB expanding to MB of zeros) and an archive past ``archive_max_mb``
    are refused before any member is written, and leave nothing beside ``root``."""
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zipped:
        for split in ("train", "test"):
            zipped.writestr(f"{split}/a/zeros.jpg", b"\0" * 2_000_000)
    assert bomb.stat().st_size < 20_000
    written: list[object] = []
    monkeypatch.setattr(zipfile.ZipFile, "extractall", lambda *a, **k: written.append(a))
    with pytest.raises(ValueError, match=r"bomb.zip \(.* bytes\) expands to 4,000,000 bytes, "
                                         r"past .* or 100 times its size"):
        _module(tmp_path, bomb).prepare_data()
    assert not written and list((tmp_path / "data").iterdir()) == []

    archive = _tar(tiny_image_folder, tmp_path / "c.tar.gz")
    small = CIFAR10DataModule(root=str(tmp_path / "data" / "cifar10"), archive=str(archive),
                              archive_max_mb=0.001, **LOADER)
    with pytest.raises(ValueError, match="past the limit of 1,000 bytes .*archive_max_mb.*"
                                         "extract it yourself"):
        small.prepare_data()
    assert list((tmp_path / "data").iterdir()) == []
    with pytest.raises(ValueError, match="archive_max_mb must be a positive number"):
        CIFAR10DataModule(archive_max_mb=float("nan"))
