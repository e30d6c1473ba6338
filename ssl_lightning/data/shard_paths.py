"""Names read from shard files stay inside their folder, and shards hold only data.

A shard manifest names shard folders and their files, litdata's ``index.json`` names chunk files
and the serializer of each field of a sample. All of them come from a folder that may have been
downloaded from anywhere: a name is accepted only as a plain file or folder name (no separator,
not ``.`` or ``..``) and is checked again, resolved, to stay inside its root before anything is
opened or written (:func:`inside`); a serializer is accepted only from
:data:`ALLOWED_SERIALIZERS` (litdata's ``pickle`` serializer, for one, runs code on read). A
file's content is checked against the manifest by its SHA-256 (:func:`file_sha256`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any


class ShardError(ValueError):
    """A shard folder that does not match its manifest, or holds what it must not (the message
    names the shard)."""


#: The litdata serializers (``index.json``'s ``config.data_format``) of a shard's fields: those
#: the shard command writes (the image's bytes, its label, its source path); none runs code.
ALLOWED_SERIALIZERS = frozenset({"bytes", "int", "str"})

#: A plain file or folder name: no separator, no drive, not ``.`` or ``..``.
_PLAIN = re.compile(r"[^/\\:\x00]+")


def name_problem(name: Any, what: str) -> str | None:
    """What makes ``name`` (a ``what`` read from a shard file) other than a plain name."""
    if not isinstance(name, str) or _PLAIN.fullmatch(name) is None or name in (".", ".."):
        return (f"its {what} {name!r} is not a plain file name (a name read from a shard "
                "folder must stay inside it)")
    return None


def inside(root: Path, relative: str) -> Path:
    """``root / relative``, checked (resolved, links followed) to stay inside ``root``.

    Raises:
        ValueError: the path leaves ``root`` (the message names both).
    """
    path = root / relative
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"{relative!r} leaves its folder {root}: refused (a name read from a "
                         "shard folder must stay inside it).")
    return path


def index_problem(index: dict[str, Any]) -> str | None:
    """What in litdata's ``index.json`` (parsed) could run code or leave the shard folder:
    a serializer outside :data:`ALLOWED_SERIALIZERS` or a chunk that is not a plain name."""
    config = index.get("config")
    formats = config.get("data_format") if isinstance(config, dict) else None
    if not isinstance(formats, list) or not formats:
        return "its litdata index.json names no data_format"
    for field, serializer in enumerate(formats):
        if serializer not in ALLOWED_SERIALIZERS:
            return (f"its litdata index.json gives field {field} the serializer {serializer!r} "
                    f"(data_format), outside the allowed {sorted(ALLOWED_SERIALIZERS)}: refused "
                    "before reading, as it could run code")
    for chunk in index.get("chunks") or []:
        problem = name_problem(chunk.get("filename") if isinstance(chunk, dict) else None,
                               "chunk file")
        if problem is not None:
            return problem
    return None


def index_file_problem(path: Path) -> str | None:
    """:func:`index_problem` of the litdata index file ``path``, or why it cannot be read."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"its litdata index.json cannot be read ({err})"
    return index_problem(index) if isinstance(index, dict) else "its index.json is not an object"


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    """The hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()
