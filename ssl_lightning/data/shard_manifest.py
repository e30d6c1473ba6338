"""The manifest of a shard folder written by ``python -m ssl_lightning shard`` and its checks.

A shard folder holds ``manifest.json`` and one sub-folder per shard (``shard-00000``, ...),
each a complete litdata dataset (its chunk file ``chunk-0-0.bin`` and ``index.json``). The
manifest records the source folder, the classes, the shard size and, per shard, its image
count, its labels and the size and SHA-256 of each of its files. :func:`verify_shards` checks a
folder against its manifest before training: a missing shard, a truncated (or grown) file, a
shard whose litdata index disagrees with the manifest, and (optionally) a changed checksum each
stop with a :class:`ShardError` naming the shard.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "ssl_lightning.shards"
VERSION = 1
#: litdata's index file in each shard folder.
LITDATA_INDEX = "index.json"


class ShardError(ValueError):
    """A shard folder that does not match its manifest (the message names the shard)."""


def shard_name(number: int) -> str:
    """The folder name of shard ``number``."""
    return f"shard-{number:05d}"


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    """The hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def describe_shard(folder: Path, labels: list[int]) -> dict[str, Any]:
    """The manifest entry of a written shard folder: name, count, labels, bytes, files."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file()}
    return {"name": folder.name, "count": len(labels), "labels": labels,
            "bytes": sum(f["bytes"] for f in files.values()), "files": files}


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of the shard folder ``root``.

    Raises:
        FileNotFoundError: ``root`` or its manifest is missing (how to make one).
        ShardError: the manifest is not a readable shard manifest of this version.
    """
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"No shard manifest {path}: {root} is not a shard folder. Make one with "
            f"`python -m ssl_lightning shard --images IMAGE_DIR --output {root}`.")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ShardError(f"The shard manifest {path} cannot be read ({err}); rerun the shard "
                         "command into a new folder.") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != VERSION:
        raise ShardError(f"{path} is not a version-{VERSION} {FORMAT} manifest.")
    return manifest


def verify_shard(root: Path, entry: dict[str, Any], checksums: bool) -> str | None:
    """What is wrong with one shard of ``root`` against its manifest ``entry`` (None: fine)."""
    folder = root / entry["name"]
    if not folder.is_dir():
        return f"shard {entry['name']} is missing (no folder {folder})"
    for name, expected in entry["files"].items():
        path = folder / name
        if not path.is_file():
            return f"shard {entry['name']} lacks its file {name}"
        size = path.stat().st_size
        if size != expected["bytes"]:
            kind = "truncated" if size < expected["bytes"] else "larger than written"
            return (f"shard {entry['name']} is {kind}: {name} has {size} bytes, the manifest "
                    f"{expected['bytes']}")
        if checksums and file_sha256(path) != expected["sha256"]:
            return f"shard {entry['name']}: the SHA-256 of {name} differs from the manifest's"
    try:
        index = json.loads((folder / LITDATA_INDEX).read_text(encoding="utf-8"))
        count = sum(int(chunk["chunk_size"]) for chunk in index["chunks"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"shard {entry['name']} has no readable litdata {LITDATA_INDEX} ({err})"
    if count != entry["count"] or len(entry["labels"]) != entry["count"]:
        return (f"shard {entry['name']} holds {count} samples, the manifest says "
                f"{entry['count']} (a manifest of another shard folder?)")
    return None


def verify_shards(root: str | Path, checksums: bool = False) -> dict[str, Any]:
    """Check every shard of ``root`` against the manifest (sizes and litdata index; the
    SHA-256 of every file too with ``checksums``) and return the manifest.

    Raises:
        ShardError: naming the first bad shard and what to do; also for an unfinished folder.
    """
    root = Path(root)
    manifest = read_manifest(root)
    if not manifest.get("complete"):
        raise ShardError(
            f"The shard folder {root} is unfinished ({len(manifest['shards'])} shards written): "
            f"the shard command was interrupted. Rerun `python -m ssl_lightning shard --images "
            f"{manifest['images']} --output {root}` to finish it.")
    total = sum(entry["count"] for entry in manifest["shards"])
    if total != manifest["num_images"]:
        raise ShardError(f"The manifest of {root} lists {total} images in its shards but "
                         f"num_images={manifest['num_images']}; rewrite the shard folder.")
    for entry in manifest["shards"]:
        problem = verify_shard(root, entry, checksums)
        if problem is not None:
            raise ShardError(
                f"Shard folder {root}: {problem}. Rerun `python -m ssl_lightning shard "
                f"--images {manifest['images']} --output {root}`, which rewrites the shards "
                "that do not match the manifest, or copy the shard again.")
    return manifest
