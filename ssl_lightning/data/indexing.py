"""Listing the images of a folder fast, with the list cached until the folder changes.

:func:`find_images` walks with :func:`os.scandir`, whose entries carry their type, so a
regular file costs no system call of its own: only folders are ``stat``-ed (to walk each real
folder once), and only symbolic links are resolved. A million files in 1,000 folders list in a
few seconds (``python benchmarks/index_speed.py``).

A dataset's index is cached (:func:`index_images`) in ``$SSL_LIGHTNING_CACHE_DIR``
(default ``~/.cache/ssl_lightning/image_index``), one JSON file per user and resolved dataset
folder, holding that folder's path, with the modification time, status-change time and inode
of every folder walked (:func:`folder_state`): adding, removing or renaming a file changes its
folder's times, and setting a folder's modification time back (``rsync -a``, ``cp -a``,
``tar x``) changes its status-change time, so a cached index is used only while every folder
still has its recorded state. An index with a folder changed less than :data:`SETTLE_S` seconds
before the walk is not cached (a change within the file system's timestamp granularity would
go unseen: git's "racily clean" index entries). A cache file is data: one owned by another
user, for another folder, damaged, or naming anything but plain relative image names inside
the folder (no ``..``, no absolute or hidden path, an image or array extension, labeled files
inside their class folder) is ignored with a warning naming it, and rewritten.
``SSL_LIGHTNING_INDEX_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from pathlib import Path

from ssl_lightning.io.atomic import atomic_open

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
#: The files ``image_reader: array`` reads (:mod:`ssl_lightning.data.arrays`): also NumPy arrays.
ARRAY_EXTENSIONS = (*IMAGE_EXTENSIONS, ".npy")
#: Folders modified this recently (seconds) are listed but not cached.
SETTLE_S = 2.0
_CACHE_VERSION = 2


def is_image_name(name: str, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> bool:
    """True for a visible file name with one of ``extensions`` (lower case)."""
    return not name.startswith(".") and name.lower().endswith(extensions)


def directory_key(path: str | Path) -> tuple[int, int]:
    """The (device, inode) of ``path`` (links followed): the identity of a real folder."""
    info = os.stat(path)
    return info.st_dev, info.st_ino


def parent_keys(root: str | Path) -> set[tuple[int, int]]:
    """The (device, inode) keys of ``root`` and of every folder above it."""
    real = Path(os.path.realpath(root))
    return {directory_key(folder) for folder in (real, *real.parents)}


def subfolders(root: str | Path) -> list[os.DirEntry]:
    """``root``'s visible sub-folders (links followed; links to ``root`` or above skipped),
    sorted by name."""
    above = parent_keys(root)
    with os.scandir(root) as entries:
        found = [e for e in entries if not e.name.startswith(".") and _is_dir(e)
                 and _entry_key(e) not in above]
    return sorted(found, key=lambda e: e.name)


def has_loose_images(root: str | Path) -> bool:
    """True if ``root`` itself (not its sub-folders) holds an image file."""
    with os.scandir(root) as entries:
        return any(is_image_name(e.name) and _is_file(e) for e in entries)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _entry_key(entry: os.DirEntry) -> tuple[int, int] | None:
    try:
        info = entry.stat()
    except OSError:  # a broken link
        return None
    return info.st_dev, info.st_ino


def walk_images(root: str | Path, extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                ) -> tuple[list[str], dict[str, list[int]]]:
    """The image files (``extensions``) under ``root`` (sorted) and the folders walked with their
    :func:`folder_state`.

    Hidden entries are skipped. Symbolic links are followed, but every real folder is walked
    once (a link to a folder above or already walked is skipped, so a link loop adds nothing)
    and every real file is listed once, under the first path a sorted, top-down walk reaches it
    by.
    """
    root = os.fspath(root)
    visited = parent_keys(root)
    by_real_path: dict[str, str] = {}
    folders: dict[str, list[int]] = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            folders[folder] = folder_state(folder)
            with os.scandir(folder) as scan:
                entries = sorted(scan, key=lambda e: e.name)
        except OSError:
            continue
        real_folder = os.path.realpath(folder)
        children = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if _is_dir(entry):
                key = _entry_key(entry)
                if key is not None and key not in visited:
                    visited.add(key)
                    children.append(entry.path)
            elif is_image_name(entry.name, extensions) and _is_file(entry):
                real = (os.path.realpath(entry.path) if entry.is_symlink()
                        else os.path.join(real_folder, entry.name))
                by_real_path.setdefault(real, entry.path)
        stack.extend(reversed(children))
    return sorted(by_real_path.values()), folders


def find_images(root: str | Path, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> list[str]:
    """All image files under ``root`` (recursive, hidden entries skipped), sorted; see
    :func:`walk_images`."""
    return walk_images(root, extensions)[0]


def cache_directory() -> Path | None:
    """Where the index cache lives, None when ``SSL_LIGHTNING_INDEX_CACHE=0``."""
    if os.environ.get("SSL_LIGHTNING_INDEX_CACHE", "1") == "0":
        return None
    given = os.environ.get("SSL_LIGHTNING_CACHE_DIR")
    base = Path(given) if given else Path.home() / ".cache" / "ssl_lightning"
    return base / "image_index"


def folder_state(path: str) -> list[int]:
    """What a cached index records of a folder: its modification and status-change times (ns)
    and its (device, inode). Setting the modification time back (``rsync -a``, ``cp -a``,
    ``tar x``) sets the status-change time to now, which no program can set back."""
    info = os.stat(path)
    return [info.st_mtime_ns, info.st_ctime_ns, info.st_dev, info.st_ino]


def _walk_dataset(root: str, labeled: bool, extensions: tuple[str, ...],
                  ) -> tuple[list[str], list[list[str]], dict[str, list[int]]]:
    """The classes, each class's images (one list, class -1, when unlabeled) and the folders
    walked with their :func:`folder_state`."""
    if not labeled:
        files, folders = walk_images(root, extensions)
        return [], [files], folders
    classes = [entry.name for entry in subfolders(root)]
    folders = {root: folder_state(root)}
    per_class = []
    for name in classes:
        files, walked = walk_images(os.path.join(root, name), extensions)
        per_class.append(files)
        folders.update(walked)
    return classes, per_class, folders


def _cache_file(real_root: str, labeled: bool, extensions: tuple[str, ...],
                cache_dir: Path) -> Path:
    """The cache file of the resolved folder ``real_root`` for this user (one per layout and
    extension set)."""
    user = os.getuid() if hasattr(os, "getuid") else ""
    key = f"{real_root}\0{user}\0{'labeled' if labeled else 'unlabeled'}\0{extensions}"
    return cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


class BadCacheError(ValueError):
    """A cache file that is not a cached index of the folder asked for (damaged, foreign,
    another user's, or naming files outside the folder)."""


_SEPARATORS = re.escape(os.sep + (os.altsep or ""))
#: A plain relative name: parts separated by ``os.sep``, none empty, none starting with ``.``
#: (no ``.``, ``..`` or hidden part), no leading separator, no NUL.
_PLAIN_NAME = re.compile(rf"(?:[^{_SEPARATORS}\0.][^{_SEPARATORS}\0]*{re.escape(os.sep)})*"
                         rf"[^{_SEPARATORS}\0.][^{_SEPARATORS}\0]*")


def _plain_names(names: object, extensions: tuple[str, ...], under: str = "") -> list[str]:
    """``names`` if each is a plain relative path below the folder (:data:`_PLAIN_NAME`)
    ending with one of ``extensions`` (and starting with ``under/`` when given), else
    :class:`BadCacheError` naming the first that is not."""
    if not isinstance(names, list):
        raise BadCacheError(f"a file list is {type(names).__name__}, not a list")
    plain, prefix = _PLAIN_NAME.fullmatch, under + os.sep if under else ""
    for name in names:
        if not (isinstance(name, str) and plain(name) and name.lower().endswith(extensions)
                and name.startswith(prefix)):
            where = f" (in class folder {under!r})" if under else ""
            raise BadCacheError(f"it names {name!r}, which is not a plain relative image name "
                                f"inside the folder{where}")
    return names


def _cached_listing(cached: dict, root: str, real_root: str, labeled: bool,
                    extensions: tuple[str, ...]) -> tuple[list[str], list[list[str]]] | None:
    """The classes and files of a parsed cache file, None when a folder changed since it was
    written.

    Raises:
        BadCacheError: it is not this user's index of ``real_root``, or names anything but
            plain image names inside the folder.
    """
    if cached.get("root") != real_root:
        raise BadCacheError(f"it indexes {cached.get('root')!r}, not {real_root!r}")
    classes, names, folders = cached["classes"], cached["files"], cached["folders"]
    if not isinstance(classes, list) or not isinstance(names, list) or \
            not isinstance(folders, dict) or len(names) != (len(classes) if labeled else 1):
        raise BadCacheError("its classes and file lists do not match")
    if "." not in folders:
        raise BadCacheError("it records no state of the folder itself")
    for folder, state in folders.items():
        if os.path.isabs(folder) or ".." in Path(folder).parts:
            raise BadCacheError(f"it records the folder {folder!r} outside the folder")
        if not isinstance(state, list) or not all(isinstance(v, int) for v in state):
            raise BadCacheError(f"the recorded state of {folder!r} is not a list of integers")
    for name in _plain_names(classes, ("",)):
        if os.sep in name:
            raise BadCacheError(f"its class {name!r} is not a folder name")
    checked = [_plain_names(files, extensions, classes[i] if labeled else "")
               for i, files in enumerate(names)]
    for folder, state in folders.items():
        try:
            if folder_state(os.path.join(root, folder)) != state:
                return None
        except OSError:
            return None
    base = os.path.join(root, "")  # the names are plain relative names: joined by adding
    return list(classes), [[base + name for name in files] for files in checked]


def _read_cache(path: Path, root: str, real_root: str, labeled: bool,
                extensions: tuple[str, ...]) -> tuple[list[str], list[list[str]]] | None:
    """The cached classes and files if ``path`` is this user's cached index of ``root`` and no
    folder changed since; a cache file that is damaged, foreign or names anything but plain
    image names inside the folder is ignored (and rewritten) with a warning naming it."""
    try:
        if hasattr(os, "getuid") and path.stat().st_uid != os.getuid():
            raise BadCacheError("it belongs to another user")
        cached = json.loads(path.read_text())
        if not isinstance(cached, dict):
            raise BadCacheError("it is not a JSON object")
        if cached.get("version") != _CACHE_VERSION:
            return None  # written by another version: rebuilt without a word
        return _cached_listing(cached, root, real_root, labeled, extensions)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError) as err:
        why = err if isinstance(err, BadCacheError) else f"it is not a readable index ({err})"
        warnings.warn(f"Ignoring the image-index cache file {path}: {why}. The folder {root} "
                      "is listed again and the file rewritten.", stacklevel=3)
        return None


def index_images(root: str | Path, labeled: bool, cache_dir: Path | None = None,
                 extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
                 ) -> tuple[list[str], list[list[str]]]:
    """The classes and the image files of each (:func:`walk_images` order) of a dataset folder,
    from the cache while no folder under ``root`` changed.

    Args:
        root: The folder.
        labeled: ``root/<class>/...`` (classes: the sorted sub-folders, each walked); else one
            list of every image under ``root`` and no classes.
        cache_dir: Where to keep the index; default :func:`cache_directory` (None: no cache).
        extensions: The file names listed (:data:`IMAGE_EXTENSIONS` or
            :data:`ARRAY_EXTENSIONS`); each set has its own cache entry.
    """
    root = os.path.abspath(root)
    cache_dir = cache_dir if cache_dir is not None else cache_directory()
    if cache_dir is None:
        return _walk_dataset(root, labeled, extensions)[:2]
    real_root = os.path.realpath(root)
    path = _cache_file(real_root, labeled, extensions, cache_dir)
    cached = _read_cache(path, root, real_root, labeled, extensions)
    if cached is not None:
        return cached
    started = time.time_ns()
    classes, files, folders = _walk_dataset(root, labeled, extensions)
    settled = started - int(SETTLE_S * 1e9)
    if all(max(state[:2]) < settled for state in folders.values()):
        prefix = len(root) + 1
        try:
            with atomic_open(path, "w") as out:
                json.dump({"version": _CACHE_VERSION, "root": real_root, "classes": classes,
                           "folders": {os.path.relpath(folder, root): state
                                       for folder, state in folders.items()},
                           "files": [[name[prefix:] for name in names] for names in files]}, out)
        except OSError:  # e.g. a read-only home: the index works, the cache does not
            pass
    return classes, files
