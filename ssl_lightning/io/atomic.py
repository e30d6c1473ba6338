"""Write a file so that it is either complete or absent: a temporary name beside the target,
flushed and fsync-ed, then ``os.replace``-d onto the target.

The temporary file lives in the target's own directory, so the rename never crosses a
filesystem (a rename across filesystems is a copy, and a copy can be cut short). Until the
rename, an existing target is untouched; after it, the target is the new, complete file. On any
error the temporary file is removed and the error re-raised; an ``OSError`` (a full disk, a
read-only directory) is re-raised naming the target.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

#: Suffix of the temporary files (``.<name>.<random>.tmp`` beside the target).
TEMP_SUFFIX = ".tmp"


def temporary_path(target: str | os.PathLike) -> Path:
    """A fresh, hidden name in ``target``'s directory (``.<name>.<random>.tmp``)."""
    path = Path(target)
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Both paths exist and name the same file (through links, ``..`` or symlinks)."""
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def _fsync(path: str | os.PathLike, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems cannot fsync a directory
        if not directory or err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``target``'s new content to; on leaving the block it
    is fsync-ed and renamed onto ``target``. The parent directory is created if needed.

    Raises:
        IsADirectoryError: ``target`` is a directory.
        OSError: Writing, syncing or renaming failed (message names ``target``); nothing is left
            at the temporary name and an existing ``target`` is unchanged.
    """
    target = Path(target)
    if target.is_dir():
        raise IsADirectoryError(
            errno.EISDIR, f"The output {os.fspath(target)!r} is a directory; name a file")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(target)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, target)
    except BaseException as err:
        with suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(err, OSError) and not isinstance(err, IsADirectoryError):
            kept = "the existing file is unchanged" if target.exists() else "nothing was written"
            message = f"Cannot write {os.fspath(target)!r} ({err.strerror or err}); {kept}"
            raise (OSError(err.errno, message) if err.errno else OSError(message)) from err
        raise
    _fsync(target.parent, directory=True)


@contextmanager
def atomic_open(target: str | os.PathLike, mode: str = "wb", **kwargs: Any) -> Iterator[IO[Any]]:
    """``open(temporary, mode, **kwargs)`` for :func:`atomic_path`: the handle is flushed and
    closed, then the file fsync-ed and renamed onto ``target``."""
    with atomic_path(target) as tmp, open(tmp, mode, **kwargs) as handle:
        yield handle


def atomic_torch_save(obj: Any, target: str | os.PathLike) -> None:
    """``torch.save(obj, target)`` through :func:`atomic_open`. The object is serialised in
    memory first, so a failed write (a full disk) is an ``OSError`` naming ``target``, not the
    serialiser's own error."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with atomic_open(target, "wb") as handle:
        handle.write(buffer.getbuffer())
