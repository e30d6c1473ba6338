"""Shard folders at a URL (``s3://``, ``gs://``, ``azure://``, ``hf://``, ``r2://``, ``local:``).

A remote shard folder is read through litdata's own downloaders (the schemes litdata's
``StreamingDataset`` accepts, with litdata's credentials): ``manifest.json`` and each shard's
``index.json`` are fetched into a local cache folder at setup, the chunks by litdata on demand
when a sample is read. The cache is one folder per URL (``<cache_dir>/<hash of the URL>``), reused
by every later run on that URL; the manifest is fetched again at each setup and must equal the
cached one, so a cache never mixes two versions of a shard folder (see ``docs/streaming.md``).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

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

    def _download(self, relative: str, local: Path, wait_s: float = 120.0) -> None:
        """Download through litdata's downloader; while another process (a DDP rank on this
        node) holds litdata's lock on the file, wait for its copy instead (up to ``wait_s``)."""
        from litdata.streaming.downloader import get_downloader

        local.parent.mkdir(parents=True, exist_ok=True)
        downloader = get_downloader(self.url, str(self.cache), [])
        deadline = time.monotonic() + wait_s
        while True:
            try:
                downloader.download_file(self.url_of(relative), str(local))
            except Exception as err:  # each backend raises its own kind for a missing object
                raise FileNotFoundError(f"cannot fetch {self.url_of(relative)} "
                                        f"({type(err).__name__}: {err})") from err
            if local.is_file():
                return
            if not Path(f"{local}.lock").exists() or time.monotonic() > deadline:
                raise FileNotFoundError(f"cannot fetch {self.url_of(relative)}")
            time.sleep(0.05)

    def fetch(self, relative: str) -> Path:
        """The cached copy of a file of the folder, downloaded unless already cached.

        Raises:
            FileNotFoundError: the file cannot be fetched (the message names its URL).
        """
        local = self.cache / relative
        if not local.is_file():
            self._download(relative, local)
        return local

    def fetch_fresh(self, relative: str) -> Path:
        """A file fetched anew and compared with the cached copy (the manifest at each setup).

        Raises:
            FileNotFoundError: the file cannot be fetched.
            ValueError: the cached copy differs (the cache holds another version of the URL).
        """
        local = self.cache / relative
        fresh = local.with_name(f"{local.name}.tmp.{os.getpid()}")
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
