"""The manifest of a shard folder written by ``python -m ssl_lightning shard`` and its checks.

A shard folder holds ``manifest.json`` and one sub-folder per shard (``shard-00000``, ...),
each a complete litdata dataset (its chunk file ``chunk-0-0.bin`` and ``index.json``). The
manifest records the source folder, the classes, the shard size and, per shard, its image
count, its labels and the size and SHA-256 of each of its files. :func:`verify_shards` checks a
folder against its manifest before training: a missing shard, a truncated (or grown) file, a
shard whose litdata index disagrees with the manifest or names a serializer that could run code
(:mod:`~ssl_lightning.data.shard_paths`), a name that is not a plain file name, and
(optionally) a changed checksum each stop with a :class:`ShardError` naming the shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ssl_lightning.data.shard_paths import ShardError, file_sha256, index_problem, name_problem
from ssl_lightning.data.shard_source import RemoteShards

MANIFEST = "manifest.json"
FORMAT = "ssl_lightning.shards"
VERSION = 1
#: litdata's index file in each shard folder.
LITDATA_INDEX = "index.json"


def shard_name(number: int) -> str:
    """The folder name of shard ``number``."""
    return f"shard-{number:05d}"


def describe_shard(folder: Path, labels: list[int]) -> dict[str, Any]:
    """The manifest entry of a written shard folder: name, count, labels, bytes, files."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file()}
    return {"name": folder.name, "count": len(labels), "labels": labels,
            "bytes": sum(f["bytes"] for f in files.values()), "files": files}


def read_manifest(root: str | Path | RemoteShards) -> dict[str, Any]:
    """The manifest of the shard folder ``root`` (a local path or a :class:`RemoteShards`,
    whose manifest is fetched anew, :meth:`RemoteShards.fetch_fresh`).

    Raises:
        FileNotFoundError: ``root`` or its manifest is missing (how to make one).
        ShardError: the manifest is not a readable shard manifest of this version.
    """
    if isinstance(root, RemoteShards):
        try:
            path = root.fetch_fresh(MANIFEST)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"No shard manifest at {root.url_of(MANIFEST)} ({err}): {root.url} is not a "
                "shard folder, or its credentials are missing (docs/streaming.md). Make one "
                "with `python -m ssl_lightning shard --images IMAGE_DIR --output FOLDER` and "
                "upload FOLDER.") from err
        except ValueError as err:
            raise ShardError(str(err)) from err
        shown: str | Path = root.url_of(MANIFEST)
    else:
        path = shown = Path(root) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(
                f"No shard manifest {path}: {root} is not a shard folder. Make one with "
                f"`python -m ssl_lightning shard --images IMAGE_DIR --output {root}`.")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ShardError(f"The shard manifest {shown} cannot be read ({err}); rerun the shard "
                         "command into a new folder.") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != VERSION:
        raise ShardError(f"{shown} is not a version-{VERSION} {FORMAT} manifest.")
    problem = _names_problem(manifest)
    if problem is not None:
        raise ShardError(f"The shard manifest {shown} is refused: {problem}.")
    return manifest


def _names_problem(manifest: dict[str, Any]) -> str | None:
    """The first shard or file name of ``manifest`` that is not a plain name (None: none)."""
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return "it lists no shards"
    for entry in shards:
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            return f"a shard entry is not a shard description ({str(entry)[:80]})"
        problem = name_problem(entry.get("name"), "shard")
        for name in entry["files"]:
            problem = problem or name_problem(name, f"file of shard {entry['name']!r}")
        if problem is not None:
            return problem
    return None


def _size_problem(shard: str, name: str, size: int, expected: int) -> str | None:
    """The message of a file whose size differs from the manifest's (None: the same)."""
    if size == expected:
        return None
    kind = "truncated" if size < expected else "larger than written"
    return f"shard {shard} is {kind}: {name} has {size} bytes, the manifest {expected}"


def _index_problem(shard: str, entry: dict[str, Any], index_path: Path) -> str | None:
    """What litdata's index of a shard contradicts in its manifest entry (None: nothing)."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        chunks = [(chunk["filename"], int(chunk["chunk_bytes"]), int(chunk["chunk_size"]))
                  for chunk in index["chunks"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"shard {shard} has no readable litdata {LITDATA_INDEX} ({err})"
    unsafe = index_problem(index)
    if unsafe is not None:
        return f"shard {shard}: {unsafe}"
    count = sum(size for _, _, size in chunks)
    if count != entry["count"] or len(entry["labels"]) != entry["count"]:
        return (f"shard {shard} holds {count} samples, the manifest says "
                f"{entry['count']} (a manifest of another shard folder?)")
    for name, size, _ in chunks:
        expected = entry["files"].get(name, {}).get("bytes")
        if expected != size:
            return (f"shard {shard}: litdata's {LITDATA_INDEX} lists {name} of {size} bytes, "
                    f"the manifest {expected} (a manifest of another shard folder?)")
    return None


def verify_shard(root: Path, entry: dict[str, Any], checksums: bool) -> str | None:
    """What is wrong with one shard of ``root`` against its manifest ``entry`` (None: fine)."""
    folder = root / entry["name"]
    if not folder.is_dir():
        return f"shard {entry['name']} is missing (no folder {folder})"
    for name, expected in entry["files"].items():
        path = folder / name
        if not path.is_file():
            return f"shard {entry['name']} lacks its file {name}"
        problem = _size_problem(entry["name"], name, path.stat().st_size, expected["bytes"])
        if problem is not None:
            return problem
        if checksums and file_sha256(path) != expected["sha256"]:
            return f"shard {entry['name']}: the SHA-256 of {name} differs from the manifest's"
    return _index_problem(entry["name"], entry, folder / LITDATA_INDEX)


def verify_remote_shard(remote: RemoteShards, entry: dict[str, Any],
                        checksums: bool) -> str | None:
    """:func:`verify_shard` of a shard at a URL, naming the shard's URL: its ``index.json``
    is fetched and compared with the manifest (the chunk sizes litdata will download), and the
    files already cached are checked; with ``checksums`` every file is fetched and hashed."""
    shard = remote.url_of(entry["name"])
    try:
        index = remote.fetch(f"{entry['name']}/{LITDATA_INDEX}")
    except FileNotFoundError as err:
        return f"shard {shard} is missing ({err})"
    problem = _index_problem(shard, entry, index)  # before any chunk is fetched
    if problem is not None:
        return problem
    for name, expected in entry["files"].items():
        relative = f"{entry['name']}/{name}"
        if checksums:
            try:
                remote.fetch(relative)
            except FileNotFoundError as err:
                return f"shard {shard} lacks its file {name} ({err})"
        path = remote.cache / relative
        if not path.is_file():
            continue  # downloaded by litdata when first read; its size is in the index
        problem = _size_problem(shard, name, path.stat().st_size, expected["bytes"])
        if problem is not None:
            return f"{problem} (the copy {path})"
        if checksums and file_sha256(path) != expected["sha256"]:
            return f"shard {shard}: the SHA-256 of {name} differs from the manifest's"
    return None


def verify_shards(root: str | Path | RemoteShards, checksums: bool = False) -> dict[str, Any]:
    """Check every shard of ``root`` (a local path or a :class:`RemoteShards`) against the
    manifest (sizes and litdata index; the SHA-256 of every file too with ``checksums``) and
    return the manifest.

    Raises:
        ShardError: naming the first bad shard and what to do; also for an unfinished folder.
    """
    manifest = read_manifest(root)
    remote: RemoteShards | None = None
    if isinstance(root, RemoteShards):
        remote = root
        where: str | Path = remote.url
        repair = (f"Rewrite it with `python -m ssl_lightning shard --images "
                  f"{manifest['images']} --output FOLDER` and upload FOLDER to {where} again, or "
                  "copy the shard again.")
    else:
        where = Path(root)
        repair = (f"Rerun `python -m ssl_lightning shard --images {manifest['images']} "
                  f"--output {where}`, which rewrites the shards that do not match the "
                  "manifest, or copy the shard again.")
    if not manifest.get("complete"):
        finish = (f"Rerun `python -m ssl_lightning shard --images {manifest['images']} --output "
                  f"FOLDER` on the folder it was written to and upload FOLDER to {where} again."
                  if remote is not None else
                  f"Rerun `python -m ssl_lightning shard --images {manifest['images']} --output "
                  f"{where}` to finish it.")
        raise ShardError(
            f"The shard folder {where} is unfinished ({len(manifest['shards'])} shards written): "
            f"the shard command was interrupted. {finish}")
    total = sum(entry["count"] for entry in manifest["shards"])
    if total != manifest["num_images"]:
        raise ShardError(f"The manifest of {where} lists {total} images in its shards but "
                         f"num_images={manifest['num_images']}; rewrite the shard folder.")
    for entry in manifest["shards"]:
        problem = (verify_remote_shard(remote, entry, checksums) if remote is not None
                   else verify_shard(Path(where), entry, checksums))
        if problem is not None:
            raise ShardError(f"Shard folder {where}: {problem}. {repair}")
    return manifest
