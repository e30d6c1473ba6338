"""The image index (ssl_lightning/data/indexing.py): every image listed once, in a stable sorted
order, equal to a plain os.walk + realpath listing; and its cache, used only while no folder
changed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ssl_lightning.data import indexing
from ssl_lightning.data.datasets import ImageFolderDataset
from ssl_lightning.data.indexing import IMAGE_EXTENSIONS, index_images, walk_images


def reference_listing(root: Path) -> list[str]:
    """The listing written the slow, obvious way: os.walk following links, each real folder
    walked once, each real file kept under the first path reaching it."""
    seen_dirs = {os.stat(p).st_ino for p in (root.resolve(), *root.resolve().parents)}
    first: dict[str, str] = {}
    for directory, subdirs, files in os.walk(root, followlinks=True):
        keep = []
        for name in sorted(subdirs):
            path = os.path.join(directory, name)
            if name.startswith(".") or not os.path.exists(path):
                continue
            if os.stat(path).st_ino not in seen_dirs:
                seen_dirs.add(os.stat(path).st_ino)
                keep.append(name)
        subdirs[:] = keep
        for name in sorted(files):
            path = os.path.join(directory, name)
            if (not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)
                    and os.path.isfile(path)):
                first.setdefault(os.path.realpath(path), path)
    return sorted(first.values())


def settle(root: Path) -> None:
    """Date every folder's modification time under ``root`` 10 s back, past the cache's
    settling time (its status-change time stays recent)."""
    old = time.time() - 10
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()]]:
        os.utime(folder, (old, old))


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every folder counts as settled: a folder's status-change time, which the cache also
    waits on, cannot be dated back."""
    monkeypatch.setattr(indexing, "SETTLE_S", -60.0)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    for folder in ("a", "a/deep/er", "b", ".hidden", "c"):
        (root / folder).mkdir(parents=True)
    for name in ("a/1.jpg", "a/2.PNG", "a/notes.txt", "a/.3.jpg", "a/deep/er/4.webp",
                 "b/5.jpeg", ".hidden/6.jpg", "c/7.tif", "8.bmp"):
        (root / name).touch()
    (root / "a" / "loop").symlink_to(root)                  # a link back to the root
    (root / "b" / "again").symlink_to(root / "a" / "deep")  # a folder reached twice
    (root / "c" / "alias.jpg").symlink_to(root / "b" / "5.jpeg")  # a file reached twice
    (root / "c" / "broken.jpg").symlink_to(root / "missing.jpg")
    return root


def test_every_image_is_listed_once_as_the_plain_walk_lists_it(tree: Path) -> None:
    files, folders = walk_images(tree)
    assert files == reference_listing(tree)
    assert files == sorted(files) and len(set(map(os.path.realpath, files))) == len(files)
    assert {Path(f).name for f in files} == {"1.jpg", "2.PNG", "4.webp", "5.jpeg", "7.tif",
                                            "8.bmp"}
    assert str(tree / "a" / "deep") in folders and str(tree / "b" / "again") not in folders
    assert walk_images(tree)[0] == files  # stable


def test_the_cache_is_used_while_no_folder_changed(tree: Path, tmp_path: Path, settled: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    settle(tree)
    classes, files = index_images(tree, labeled=True, cache_dir=cache)
    assert classes == ["a", "b", "c"] and len(list(cache.iterdir())) == 1
    with monkeypatch.context() as patched:  # a second call must not walk
        patched.setattr(indexing, "walk_images", lambda root: pytest.fail("walked again"))
        assert index_images(tree, labeled=True, cache_dir=cache) == (classes, files)
    (tree / "a" / "deep" / "new.jpg").touch()  # changes a/deep's time: the index is stale
    classes, files = index_images(tree, labeled=True, cache_dir=cache)
    assert str(tree / "a" / "deep" / "new.jpg") in files[0]
    settle(tree)
    index_images(tree, labeled=True, cache_dir=cache)
    (tree / "b" / "5.jpeg").unlink()
    _, files = index_images(tree, labeled=True, cache_dir=cache)
    assert not any(path.endswith("5.jpeg") for path in files[1])
    (tree / "d").mkdir()  # a new class folder changes the root's time
    assert index_images(tree, labeled=True, cache_dir=cache)[0] == ["a", "b", "c", "d"]


def test_a_folder_changed_just_now_is_not_cached(tree: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    settle(tree)
    (tree / "a" / "fresh.jpg").touch()
    index_images(tree, labeled=False, cache_dir=cache)
    assert not cache.exists() or not list(cache.iterdir())


def test_a_damaged_or_foreign_cache_file_is_ignored(tree: Path, tmp_path: Path,
                                                    settled: None) -> None:
    cache = tmp_path / "cache"
    settle(tree)
    expected = index_images(tree, labeled=False, cache_dir=cache)
    (cache_file,) = cache.iterdir()
    cache_file.write_text("{not json")
    with pytest.warns(UserWarning, match=f"{cache_file}: it is not a readable index"):
        assert index_images(tree, labeled=False, cache_dir=cache) == expected
    content = json.loads(cache_file.read_text())
    content["root"] = "/somewhere/else"
    cache_file.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match="it indexes '/somewhere/else'"):
        assert index_images(tree, labeled=False, cache_dir=cache) == expected


def test_the_dataset_lists_what_the_walk_lists(tree: Path, tmp_path: Path, settled: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_LIGHTNING_CACHE_DIR", str(tmp_path / "cache"))
    settle(tree)
    for _ in range(2):  # walked, then from the cache
        unlabeled = ImageFolderDataset(tree, labeled=False)
        assert [path for path, _ in unlabeled.samples] == reference_listing(tree)
        labeled = ImageFolderDataset(tree, labeled=True)
        assert labeled.classes == ["a", "b", "c"]
        assert labeled.samples == [(path, index) for index, name in enumerate(labeled.classes)
                                   for path in reference_listing(tree / name)]
    assert len(list((tmp_path / "cache" / "image_index").iterdir())) == 2
    monkeypatch.setenv("SSL_LIGHTNING_INDEX_CACHE", "0")
    assert indexing.cache_directory() is None


# ------------------------------------------------------------------------ the cache file is data
def cached_content(cache: Path) -> tuple[Path, dict]:
    (cache_file,) = cache.iterdir()
    return cache_file, json.loads(cache_file.read_text())


@pytest.mark.parametrize("entry", ["../secret/id_rsa.jpg", "../../secret/id_rsa", "/etc/passwd",
                                   "a/notes.txt", ".hidden/6.jpg", "a/./1.jpg", "a//1.jpg", 7])
def test_a_cache_entry_outside_the_folder_or_not_an_image_is_never_read(
        tree: Path, tmp_path: Path, settled: None, entry: object) -> None:
    """A writable cache must not choose what training and ``shard`` read: names that leave the
    folder, or are no image names, make the whole cache file ignored (and rewritten)."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "id_rsa.jpg").write_bytes(b"key")
    cache = tmp_path / "cache"
    expected = index_images(tree, labeled=False, cache_dir=cache)
    cache_file, content = cached_content(cache)
    content["files"][0].append(entry)
    cache_file.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match=f"cache file {cache_file}: it names|an entry is int"):
        assert index_images(tree, labeled=False, cache_dir=cache) == expected
    assert index_images(tree, labeled=False, cache_dir=cache) == expected  # rewritten


@pytest.mark.parametrize(("change", "why"), [
    ({"folders": {}}, "records no state of the folder itself"),
    ({"folders": {".": [0, 0, 0, 0], "../..": [0, 0, 0, 0]}}, "records the folder '../..'"),
    ({"classes": ["a", "../b", "c"]}, "names '../b'"), ({"files": "a.jpg"}, "do not match"),
    ({"files": [[[]], [], []]}, "an entry is list|names \\[\\]"),
])
def test_a_cache_with_crafted_folders_or_classes_is_ignored(tree: Path, tmp_path: Path,
                                                            settled: None, change: dict,
                                                            why: str) -> None:
    """A cache that records no folder would never go stale; one that records folders or
    classes outside the data folder is not an index of it."""
    cache = tmp_path / "cache"
    expected = index_images(tree, labeled=True, cache_dir=cache)
    cache_file, content = cached_content(cache)
    cache_file.write_text(json.dumps({**content, **change}))
    with pytest.warns(UserWarning, match=f"cache file {cache_file}: .*{why}"):
        assert index_images(tree, labeled=True, cache_dir=cache) == expected


def test_a_labeled_cache_keeps_each_file_in_its_class_folder(tree: Path, tmp_path: Path,
                                                             settled: None) -> None:
    cache = tmp_path / "cache"
    expected = index_images(tree, labeled=True, cache_dir=cache)
    cache_file, content = cached_content(cache)
    content["files"][0].append("b/5.jpeg")  # class b's image listed as class a
    cache_file.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match="in class folder 'a'"):
        assert index_images(tree, labeled=True, cache_dir=cache) == expected


def test_one_users_cache_is_not_read_as_another_users(tree: Path, tmp_path: Path, settled: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    expected = index_images(tree, labeled=False, cache_dir=cache)
    other = os.getuid() + 1
    with monkeypatch.context() as patched:  # another user: their own entry, a walk
        patched.setattr(os, "getuid", lambda: other)
        walks = []
        patched.setattr(indexing, "walk_images",
                        lambda *a: walks.append(a) or walk_images(*a))
        assert index_images(tree, labeled=False, cache_dir=cache) == expected
        assert walks and len(list(cache.iterdir())) == 2
    with monkeypatch.context() as patched:  # a file under their name not owned by them
        patched.setattr(os, "getuid", lambda: other)
        with pytest.warns(UserWarning, match="belongs to another user"):
            assert index_images(tree, labeled=False, cache_dir=cache) == expected


def test_a_file_copied_in_with_its_folder_time_set_back_is_seen(tree: Path, tmp_path: Path,
                                                                 settled: None) -> None:
    """``rsync -a`` / ``cp -a`` / ``tar x`` add a file and then set the folder's modification
    time back to the source's: the cached index must not hide the new file."""
    cache = tmp_path / "cache"
    folder = tree / "a" / "deep"
    before = os.stat(folder)
    index_images(tree, labeled=True, cache_dir=cache)
    (folder / "copied.jpg").touch()
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(folder).st_mtime_ns == before.st_mtime_ns
    _, files = index_images(tree, labeled=True, cache_dir=cache)
    assert str(folder / "copied.jpg") in files[0]
    replaced = tree / "b"  # a class folder replaced by a copy with the same times
    before, root_before = os.stat(replaced), os.stat(tree)
    os.rename(replaced, tmp_path / "old_b")
    replaced.mkdir()
    (replaced / "other.jpg").touch()
    for path, stat in ((replaced, before), (tree, root_before)):
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _, files = index_images(tree, labeled=True, cache_dir=cache)
    assert files[1] == [str(replaced / "other.jpg")]
