"""A folder of images written as litdata shards (the encoded image bytes, unchanged, with the
ImageFolder label and the file's path), read back by
:class:`~ssl_lightning.data.StreamingDataModule` (the ``shard`` command:
:mod:`ssl_lightning.cli.shard`).

Each shard of ``--shard-size`` images is a litdata dataset folder of its own
(:mod:`ssl_lightning.data.shard_manifest`), written under a temporary name in the output
folder and renamed when complete; the manifest is written (atomically) before the first shard
and rewritten after every shard, so the folder always has one. An interrupted run (killed at
any point; out of disk space, the partial shard is removed and named) resumes: shards listed
in the manifest are verified (sizes and SHA-256) and kept, a shard that fails is rewritten, and
the run continues after the last one. An output URL is refused (write locally, then upload).
Labels are the sorted class folders when ``--images`` holds only class folders (at least 2), as
:class:`~ssl_lightning.data.ImageFolderDataModule` reads them; otherwise -1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from ssl_lightning.data.datasets import UNLABELED, check_directory, has_class_folders
from ssl_lightning.data.indexing import index_images
from ssl_lightning.data.shard_manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    describe_shard,
    read_manifest,
    shard_name,
    verify_shard,
)
from ssl_lightning.data.shard_source import is_url
from ssl_lightning.io.atomic import atomic_open

#: Prefix and suffix of a shard being written (``.shard-00003.<random>.tmp``).
_TEMP_PREFIX, _TEMP_SUFFIX = ".shard-", ".tmp"
#: A URL's scheme (``s3://``, ``hf://``, ``local:``...): not a local output folder.
_SCHEME = re.compile(r"[A-Za-z][\w+.-]+:(//|(?=/))")


def list_source(images: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """The classes and the ``(path relative to images, label)`` of every image, in the order
    :class:`~ssl_lightning.data.ImageFolderDataset` lists them."""
    labeled = has_class_folders(images)
    classes, files = index_images(images, labeled)
    if labeled and len(classes) < 2:
        labeled, (classes, files) = False, index_images(images, False)
    prefix = len(os.path.abspath(images)) + 1
    samples = [(path[prefix:], label if labeled else UNLABELED)
               for label, paths in enumerate(files) for path in paths]
    if not samples:
        raise FileNotFoundError(f"No images found under {images}.")
    return (classes if labeled else []), samples


def _digest(samples: list[tuple[str, int]]) -> str:
    return hashlib.sha256(json.dumps(samples).encode()).hexdigest()


def _is_temporary(path: Path) -> bool:
    """A half-written shard or manifest of an interrupted run (a temporary name of ours)."""
    name = path.name
    return name.endswith(_TEMP_SUFFIX) and (
        name.startswith(_TEMP_PREFIX) or name.startswith(f".{MANIFEST}."))


def _write_manifest(output: Path, manifest: dict[str, Any]) -> None:
    with atomic_open(output / MANIFEST, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)


def _write_shard(images: Path, output: Path, number: int,
                 samples: list[tuple[str, int]]) -> dict[str, Any]:
    """Write one shard under a temporary name, rename it into place, return its entry."""
    from litdata.streaming.writer import BinaryWriter

    temp = output / f"{_TEMP_PREFIX}{number:05d}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
    try:
        writer = BinaryWriter(str(temp), chunk_size=len(samples))
        for index, (relative, label) in enumerate(samples):
            writer.add_item(index, ((images / relative).read_bytes(), label, relative))
        writer.done()
        writer.merge(1)
    except OSError as err:  # a full disk, a read error: the partial shard is removed
        shutil.rmtree(temp, ignore_errors=True)
        raise OSError(f"Cannot write shard {number} to {temp}: {err.strerror or err}; the "
                      "partial shard was removed. Free space (or fix the file) and rerun the "
                      "same command to resume.") from err
    final = output / shard_name(number)
    if final.exists():  # failed verification, or renamed before the manifest listed it
        shutil.rmtree(final)
    os.rename(temp, final)
    return describe_shard(final, [label for _, label in samples])


def _start(images: Path, output: Path, shard_size: int, classes: list[str],
           samples: list[tuple[str, int]]) -> dict[str, Any]:
    """The manifest to continue from: the existing one (checked to be of the same source and
    shard size) or a new one, in a new or empty folder."""
    fresh = {"format": FORMAT, "version": VERSION, "engine": "litdata",
             "images": str(images.resolve()), "classes": classes, "shard_size": shard_size,
             "num_images": len(samples), "source_sha256": _digest(samples), "complete": False,
             "bytes": 0, "shards": []}
    if not (output / MANIFEST).exists():
        if output.exists() and any(not _is_temporary(p) for p in output.iterdir()):
            raise FileExistsError(f"--output {output} holds files and no {MANIFEST}: choose a "
                                  "new or empty folder (nothing there is overwritten).")
        output.mkdir(parents=True, exist_ok=True)
        _write_manifest(output, fresh)  # before any shard: the folder is never manifest-less
        return fresh
    manifest = read_manifest(output)
    for key in ("images", "shard_size", "num_images", "source_sha256"):
        if manifest.get(key) != fresh[key]:
            raise ValueError(
                f"{output} holds shards of another source or layout ({key}: "
                f"{manifest.get(key)!r} there, {fresh[key]!r} now; the images changed or "
                "--shard-size differs). Write to a new folder.")
    return manifest


def write_shards(images: str | Path, output: str | Path, shard_size: int = 1000,
                 progress: bool = True) -> dict[str, Any]:
    """Write (or finish, or repair) the shard folder ``output`` of the images under
    ``images``; return its manifest.

    Raises:
        ValueError: ``shard_size`` < 1, or ``output`` holds shards of another source.
        FileExistsError: ``output`` holds other files and no manifest.
    """
    from tqdm import tqdm

    if shard_size < 1:
        raise ValueError(f"--shard-size must be >= 1, got {shard_size}.")
    if is_url(str(output)) or _SCHEME.match(str(output)):
        raise ValueError(
            f"--output {output}: the shard command writes a local folder, not a URL. Write "
            "it locally (--output FOLDER) and upload FOLDER as it is, e.g. `aws s3 cp "
            f"--recursive FOLDER {output}` (or `gsutil -m cp -r`, `huggingface-cli upload`), "
            "then train with train_shards: the URL.")
    images, output = check_directory(images), Path(output)
    classes, samples = list_source(images)
    manifest = _start(images, output, shard_size, classes, samples)
    for stale in filter(_is_temporary, output.iterdir()):  # of an interrupted run
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    parts = [samples[i:i + shard_size] for i in range(0, len(samples), shard_size)]
    done: list[dict[str, Any]] = manifest["shards"]
    bar = tqdm(total=len(samples), desc="shard", unit="img", disable=not progress)
    for number, entry in enumerate(list(done)):
        if verify_shard(output, entry, checksums=True) is not None:
            done[number] = _write_shard(images, output, number, parts[number])
        bar.update(entry["count"])
    for number in range(len(done), len(parts)):
        done.append(_write_shard(images, output, number, parts[number]))
        manifest["bytes"] = sum(entry["bytes"] for entry in done)
        _write_manifest(output, manifest)
        bar.update(len(parts[number]))
    bar.close()
    manifest["bytes"] = sum(entry["bytes"] for entry in done)
    manifest["complete"] = True
    _write_manifest(output, manifest)
    return manifest
