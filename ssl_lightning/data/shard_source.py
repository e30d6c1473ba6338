"""Shard folders at a URL (``s3://``, ``gs://``, ``azure://``, ``hf://``, ``r2://``, ``local:``).

A remote shard folder is read through litdata's own downloaders (the schemes litdata's
``StreamingDataset`` accepts, with litdata's credentials): ``manifest.json`` and each shard's
``index.json`` are fetched into a local cache folder at setup, a shard's chunks when a process
first opens the shard. Every file is downloaded under a name of its own, checked and renamed
into place (a lock per file keeps the processes of a node from downloading it twice), so a
reader never sees a partial file; a chunk is checked against the manifest's SHA-256 when it is
downloaded and, cached, when a process first opens its shard; every path is checked to stay
inside the cache. The cache is one folder per URL (``<cache_dir>/<hash of the URL>``), reused by
every later run on that URL; the manifest is fetched again at each setup and must equal the
cached one, so a cache never mixes two versions of a shard folder (see ``docs/streaming.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

from ssl_lightning.data.shard_paths import ShardError, file_sha256, inside

#: The parent of every URL's cache folder when ``cache_dir`` is not given.
DEFAULT_CACHE_DIR = Path("~/.cache/ssl_lightning/shards")


def url_prefixes() -> tuple[str, ...]:
    """The URL prefixes litdata downloads from (its registered downloaders)."""
    from litdata.streaming import downloader

    return tuple(downloader._DOWNLOADERS)


def is_url(location: str | Path) -> bool:
    """Whether ``location`` is a URL litdata downloads from (else a local or mounted path)."""
    return isinstance(location, str) and location.startswith(url_prefixes())


def url_cache(url: str, cache_dir: str | Path | None = None) -> Path:
    """The cache folder of ``url``: ``<cache_dir>/<first 16 hex digits of its SHA-256>``."""
    parent = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    return parent.expanduser() / hashlib.sha256(url.encode()).hexdigest()[:16]


class RemoteShards:
    """A shard folder at ``url``, its files fetched into :func:`url_cache` (``cache``).

    Args:
        url: The shard folder's URL (a prefix of :func:`url_prefixes`).
        cache_dir: Parent of the URL's cache folder (None: ``~/.cache/ssl_lightning/shards``).
    """

    def __init__(self, url: str, cache_dir: str | Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.cache = url_cache(self.url, cache_dir)

    def url_of(self, relative: str) -> str:
        """The URL of a file or folder inside the shard folder."""
        return f"{self.url}/{relative}"

    def _download(self, relative: str, local: Path, expected: dict[str, Any] | None = None,
                  wait_s: float = 600.0) -> None:
        """Download through litdata's downloader into a name of this process's own, checked
        against ``expected`` (the manifest's ``bytes`` and ``sha256``) and renamed into place:
        a reader never sees a partial or damaged file. The processes and loader workers of a
        node share a lock on the file: one downloads it, the others wait (up to ``wait_s``)
        and find it in place.

        Raises:
            FileNotFoundError: the file cannot be fetched.
            ShardError: the downloaded file differs from ``expected`` (not kept).
        """
        from filelock import FileLock, Timeout
        from litdata.streaming.downloader import get_downloader

        local.parent.mkdir(parents=True, exist_ok=True)
        lock, held = FileLock(f"{local}.lock", timeout=wait_s), False
        try:
            with lock:
                held = True
                if local.is_file():
                    return
                temp = local.with_name(f"{local.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
                try:
                    try:
                        get_downloader(self.url, str(self.cache), []).download_file(
                            self.url_of(relative), str(temp))
                    except Exception as err:  # each backend raises its own kind when missing
                        raise FileNotFoundError(f"cannot fetch {self.url_of(relative)} "
                                                f"({type(err).__name__}: {err})") from err
                    if not temp.is_file():
                        raise FileNotFoundError(f"cannot fetch {self.url_of(relative)}")
                    if expected is not None:
                        self._check(relative, temp, expected, "downloaded")
                    os.replace(temp, local)
                finally:
                    temp.unlink(missing_ok=True)
        except Timeout as err:
            raise FileNotFoundError(
                f"cannot fetch {self.url_of(relative)}: another process has held the lock "
                f"{lock.lock_file} for {wait_s:.0f} s") from err
        finally:  # as litdata does; a second copy then is harmless (renamed, never partial)
            if held:
                with contextlib.suppress(OSError):
                    os.remove(lock.lock_file)

    def _check(self, relative: str, path: Path, expected: dict[str, Any], kind: str) -> None:
        """Raise a :class:`ShardError` if ``path`` has another size or SHA-256 than
        ``expected``, naming the shard's URL and what to do."""
        shard, _, name = relative.rpartition("/")
        size = path.stat().st_size
        if size != expected["bytes"]:
            problem = f"has {size} bytes, the manifest {expected['bytes']}"
        elif file_sha256(path) != expected["sha256"]:
            problem = "has another SHA-256 than the manifest's"
        else:
            return
        if kind == "cached":
            what, fix = (f"the cached copy {path} of {name}", f"Delete the local cache folder "
                         f"{self.cache} (it holds only downloaded copies) and rerun.")
        else:
            what, fix = f"the downloaded {name}", "Upload the shard again (nothing was cached)."
        raise ShardError(f"shard {self.url_of(shard)} is damaged: {what} {problem}. {fix}")

    def fetch(self, relative: str, expected: dict[str, Any] | None = None) -> Path:
        """The cached copy of a file of the folder, downloaded unless already cached; with
        ``expected`` (the manifest's ``bytes`` and ``sha256`` of the file), checked against it.

        Raises:
            FileNotFoundError: the file cannot be fetched (the message names its URL).
            ShardError: ``relative`` leaves the cache folder, or the file differs from
                ``expected`` (the message says which cache folder to delete).
        """
        try:
            local = inside(self.cache, relative)
        except ValueError as err:
            raise ShardError(f"{self.url}: {err}") from err
        if not local.is_file():
            self._download(relative, local, expected)
        elif expected is not None:
            self._check(relative, local, expected, "cached")
        return local

    def fetch_fresh(self, relative: str) -> Path:
        """A file fetched anew and compared with the cached copy (the manifest at each setup).

        Raises:
            FileNotFoundError: the file cannot be fetched.
            ValueError: the cached copy differs (the cache holds another version of the URL).
        """
        try:
            local = inside(self.cache, relative)
        except ValueError as err:
            raise ShardError(f"{self.url}: {err}") from err
        fresh = local.with_name(f"{local.name}.fresh.{os.getpid()}.{secrets.token_hex(4)}")
        self._download(relative, fresh)
        if local.is_file() and local.read_bytes() != fresh.read_bytes():
            fresh.unlink()
            raise ValueError(
                f"{self.url_of(relative)} changed since the cache {self.cache} was filled from "
                f"it: the cache holds copies of another version of the shards. Delete "
                f"{self.cache} (it holds only downloaded copies) or set cache_dir to a new "
                "folder.")
        os.replace(fresh, local)
        return local

    def dataset_dir(self, shard: str) -> Any:
        """litdata's ``Dir`` of one shard: its URL and its cache folder."""
        from litdata.streaming.resolver import Dir

        return Dir(path=str(self.cache / shard), url=self.url_of(shard))
