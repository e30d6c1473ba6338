"""``python -m ssl_lightning embed``: the embeddings of every image under a folder.

``python -m ssl_lightning embed --checkpoint last.ckpt --images DIR --output emb.parquet``

The backbone is rebuilt from the checkpoint alone (its ``backbone_spec``) and run in eval mode
on the evaluation transform, batched, on the best available device (CUDA, else CPU). Labels come
from an ImageFolder layout (``DIR/<class>/<image>``), else -1. ``--devices N`` splits the sorted
file list into N contiguous shards (one process each: no sampler padding, order preserved); each
shard streams its rows to a part file, and the parts are then written, in order, to the output
format of the suffix (see :mod:`ssl_lightning.evaluation.embed_writers`). Unreadable images are
skipped and listed, each with the reason, in ``<output>.skipped.txt`` (``--on-error raise``
stops at the first one, naming it); none readable at all is an error that writes nothing.
A folder whose class folders are splits (``train/``, ``test/``) gets a warning naming the
labels it writes. ``--patch-features`` writes the backbone's feature map instead of its pooled
feature (:mod:`ssl_lightning.backbones.dense`): one row per image holding its (h, w, C) map
(the format of each suffix in :mod:`ssl_lightning.evaluation.embed_writers`).

Every argument, the checkpoint and the image folder are checked before any file is written; the
outputs are written to temporary names beside them and renamed when complete, so an error, a
full disk or an interrupt leaves no partial output and an existing output as it was.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from ssl_lightning.backbones.dense import dense_features, has_dense_features
from ssl_lightning.data.arrays import load_array
from ssl_lightning.data.datasets import CorruptImageError, ImageFolderDataset
from ssl_lightning.data.indexing import ARRAY_EXTENSIONS
from ssl_lightning.data.preprocessing import eval_transform
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX, backbone_from_checkpoint
from ssl_lightning.evaluation.embed_writers import EmbeddingWriter, check_output_suffix
from ssl_lightning.evaluation.preprocessing import (
    add_preprocessing_flags,
    checkpoint_preprocessing,
    preprocessing_overrides,
)
from ssl_lightning.io import atomic_open, same_file

#: Folder names that are splits of a dataset, not classes (``embed`` warns when they label).
SPLIT_NAMES = frozenset({"train", "training", "test", "testing", "val", "valid", "validation"})


class LabelWarning(UserWarning):
    """The labels ``embed`` is about to write are probably not classes."""


class _Readable(Dataset):
    """Yields ``(image, index, "")``, or ``(None, index, why)`` for an unreadable file instead
    of raising."""

    def __init__(self, folder: ImageFolderDataset, transform: Any, strict: bool) -> None:
        self.folder, self.transform, self.strict = folder, transform, strict

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[Tensor | None, int, str]:
        try:
            image = self.folder.loader(self.folder.samples[index][0])
        except CorruptImageError as err:
            if self.strict:
                raise
            return None, index, " ".join(str(err).split())  # one line
        return self.transform(image), index, ""


def _collate(items: list[tuple[Tensor | None, int, str]]
             ) -> tuple[Tensor | None, list[int], list[tuple[int, str]]]:
    good = [(x, i) for x, i, _ in items if x is not None]
    images = torch.stack([x for x, _ in good]) if good else None
    return images, [i for _, i in good], [(i, why) for x, i, why in items if x is None]


def best_device(rank: int = 0) -> torch.device:
    """``cuda:<rank>`` when CUDA is available, else the CPU."""
    return torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")


@torch.no_grad()
def embed_shard(
    backbone: nn.Module, folder: ImageFolderDataset, indices: range, part: Path, *,
    transform: Any, batch_size: int, num_workers: int, device: torch.device, strict: bool,
    progress: bool, patch_features: bool = False,
) -> tuple[int, ...]:
    """Embed ``folder[indices]`` into ``part.f32`` (raw float32 rows), ``part.tsv`` (index,
    label) and ``part.skipped`` (index and reason of each unreadable file). Returns the shape
    of a row: ``(D,)``, or ``(h, w, C)`` with ``patch_features`` (the feature map, channels
    last)."""
    from tqdm import tqdm

    backbone = backbone.to(device).eval()
    loader = DataLoader(Subset(_Readable(folder, transform, strict), list(indices)),
                        batch_size=batch_size, num_workers=num_workers, collate_fn=_collate)
    shape: tuple[int, ...] = (0,)
    with open(f"{part}.f32", "wb") as rows, open(f"{part}.tsv", "w") as meta, \
            open(f"{part}.skipped", "w") as skipped:
        for images, good, bad in tqdm(loader, desc="embed", disable=not progress,
                                      unit="batch", file=sys.stderr):
            skipped.writelines(f"{i}\t{why}\n" for i, why in bad)
            if images is None:
                continue
            if patch_features:
                features = dense_features(backbone, images.to(device))[0].permute(0, 2, 3, 1)
            else:
                features = backbone(images.to(device))
                if features.dim() != 2:
                    raise ValueError(
                        f"The backbone returned shape {tuple(features.shape)}, not (B, D).")
            shape = tuple(features.shape[1:])
            rows.write(features.float().cpu().contiguous().numpy().tobytes())
            meta.writelines(f"{i}\t{folder.samples[i][1]}\n" for i in good)
    return shape


def _shard_worker(rank: int, world: int, config: dict[str, Any]) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    folder = _folder(config["images"], config["image_reader"])
    n = len(folder)
    bounds = [n * r // world for r in range(world + 1)]
    backbone = backbone_from_checkpoint(config["checkpoint"], prefix=config["prefix"],
                                        flag="--prefix")
    shape = embed_shard(
        backbone, folder, range(bounds[rank], bounds[rank + 1]), Path(config["tmp"]) / f"{rank}",
        transform=config["transform"], batch_size=config["batch_size"],
        num_workers=config["num_workers"], device=best_device(rank), strict=config["strict"],
        progress=rank == 0, patch_features=config["patch_features"])
    (Path(config["tmp"]) / f"{rank}.shape").write_text(",".join(map(str, shape)))


def embed_folder(
    checkpoint: str, images: str, output: str, *, batch_size: int = 256, num_workers: int = 0,
    devices: int = 1, preset: str | None = None, crop_size: int | None = None,
    prefix: str = DEFAULT_PREFIX, on_error: str = "skip", chunk_rows: int = 65536,
    patch_features: bool = False, image_reader: str | None = None,
    mean: list[float] | None = None, std: list[float] | None = None,
    resize_size: int | None = None,
) -> dict[str, Any]:
    """Embed every image under ``images`` into ``output``; see the module docstring.

    The preprocessing is the checkpoint's record (:mod:`ssl_lightning.data.preprocessing`);
    ``preset``, ``crop_size``, ``resize_size``, ``image_reader``, ``mean`` and ``std`` override
    it (with a warning where the backbone was trained otherwise). A checkpoint without a record
    is embedded with the ``"cifar"`` preset and RGB images unless they are given (a warning
    says it is a guess).

    ``image_reader="array"`` reads images of any channel count in their units
    (:mod:`ssl_lightning.data.arrays`, ``.npy`` included), normalised by the per-channel
    ``mean`` and ``std`` of the pre-training data (:class:`MultiChannelEval`).

    Returns:
        ``{"rows", "dim", "shape", "skipped": [paths], "output"}``: ``shape`` is a row's,
        ``(dim,)`` or, with ``patch_features``, ``(h, w, C)``.
    """
    check_output_suffix(output)
    if os.path.isdir(output):
        raise ValueError(f"--output {output!r} is a directory; name a file in it.")
    if same_file(output, checkpoint):
        raise ValueError(f"--output {output!r} is the checkpoint; name another file.")
    if devices < 1 or batch_size < 1:
        raise ValueError(f"devices ({devices}) and batch_size ({batch_size}) must be >= 1.")
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}.")
    settings = checkpoint_preprocessing(
        checkpoint, "embed", preset=preset, crop_size=crop_size, resize_size=resize_size,
        image_reader=image_reader, mean=mean, std=std)
    transform = eval_transform(settings)
    image_reader = settings["image_reader"]
    folder = _folder(images, image_reader)  # FileNotFoundError: a missing / image-less folder
    _warn_split_labels(folder, images)
    # fail fast on a bad one
    backbone = backbone_from_checkpoint(checkpoint, prefix=prefix, flag="--prefix")
    if patch_features and not has_dense_features(backbone):
        raise ValueError(
            f"--patch-features needs a backbone with dense features; the checkpoint's "
            f"{type(backbone).__name__} has none (see ssl_lightning.backbones.dense).")
    with tempfile.TemporaryDirectory(prefix="ssl_embed_") as tmp:
        config = dict(images=images, checkpoint=checkpoint, prefix=prefix, tmp=tmp,
                      transform=transform, batch_size=batch_size, num_workers=num_workers,
                      strict=on_error == "raise", patch_features=patch_features,
                      image_reader=image_reader)
        if devices == 1:
            _shard_worker(0, 1, config)
        else:
            torch.multiprocessing.spawn(_shard_worker, args=(devices, config), nprocs=devices)
        return _write_output(folder, Path(tmp), devices, output, chunk_rows)


def _warn_split_labels(folder: ImageFolderDataset, images: str) -> None:
    """Warn when the class folders of ``images`` are splits (``train/``, ``test/``)."""
    if folder.classes and all(name.lower() in SPLIT_NAMES for name in folder.classes):
        labels = ", ".join(f"{i} = {name}" for i, name in enumerate(folder.classes))
        warnings.warn(
            f"{images} holds the folders {', '.join(folder.classes)}, which look like splits of "
            f"a dataset, not classes: the label column will be the split ({labels}). To label "
            f"by class, embed each split on its own (--images "
            f"{os.path.join(images, folder.classes[-1])}).", LabelWarning, stacklevel=3)


def _folder(images: str, image_reader: str) -> ImageFolderDataset:
    if image_reader == "array":
        return ImageFolderDataset(images, loader=load_array, extensions=ARRAY_EXTENSIONS)
    return ImageFolderDataset(images)


def _write_output(folder: ImageFolderDataset, tmp: Path, parts: int, output: str,
                  chunk_rows: int) -> dict[str, Any]:
    shape = max(tuple(int(n) for n in (tmp / f"{r}.shape").read_text().split(","))
                for r in range(parts))  # (0,) for a shard without readable images
    dim = int(np.prod(shape))
    metas = [np.loadtxt(tmp / f"{r}.tsv", dtype=np.int64, ndmin=2).reshape(-1, 2)
             for r in range(parts)]
    skipped = [(folder.samples[int(line.split("\t", 1)[0])][0], line.split("\t", 1)[1])
               for r in range(parts) for line in (tmp / f"{r}.skipped").read_text().splitlines()]
    if skipped and not any(len(m) for m in metas):
        raise ValueError(_none_readable(folder, skipped))
    with EmbeddingWriter(output, sum(len(m) for m in metas), dim, shape) as writer:
        for r, meta in enumerate(metas):
            rows = (np.memmap(tmp / f"{r}.f32", dtype=np.float32, mode="r", shape=(len(meta), dim))
                    if len(meta) else np.zeros((0, dim), np.float32))
            for start in range(0, len(meta), chunk_rows):
                chunk = meta[start:start + chunk_rows]
                writer.write([folder.samples[int(i)][0] for i in chunk[:, 0]], chunk[:, 1],
                             np.asarray(rows[start:start + chunk_rows]))
    if skipped:
        with atomic_open(f"{output}.skipped.txt", "w", encoding="utf-8") as handle:
            handle.writelines(f"{p}\t{why}\n" for p, why in skipped)
    return {"rows": writer.written, "dim": dim, "shape": shape,
            "skipped": [p for p, _ in skipped], "output": output}


def _none_readable(folder: ImageFolderDataset, skipped: list[tuple[str, str]]) -> str:
    """The message when no image of the folder could be read: the first reason, and the
    array reader for files the RGB reader cannot decode."""
    tiffs = any(Path(p).suffix.lower() in (".tif", ".tiff") for p, _ in skipped)
    hint = (" If they are multi-channel images, add --image-reader array (with --mean/--std "
            "unless the checkpoint records them)." if tiffs and folder.loader is not load_array
            else " Replace or delete the unreadable files.")
    return (f"none of the {len(skipped)} images under {folder.root} could be read, so nothing "
            f"was written (the first: {skipped[0][1]}).{hint}")


def main(args: list[str] | None = None) -> dict[str, Any]:
    """Command line of ``python -m ssl_lightning embed``."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning embed",
        description="Embed every image under a folder with a checkpoint's backbone.")
    parser.add_argument("--checkpoint", required=True, help="pre-training .ckpt file")
    parser.add_argument("--images", required=True, help="folder of images (recursive)")
    parser.add_argument("--output", required=True, help="file: .npy, .csv, .parquet or .pt")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=0, help="loader workers per device")
    parser.add_argument("--devices", type=int, default=1, help="processes (GPUs when present)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="backbone prefix in the ckpt")
    parser.add_argument("--on-error", choices=["skip", "raise"], default="skip",
                        help="unreadable images: skip and list them, or stop")
    parser.add_argument("--patch-features", action="store_true",
                        help="write each image's (h, w, C) feature map instead of its pooled "
                             "feature")
    add_preprocessing_flags(parser)
    ns = parser.parse_args(args)
    try:
        result = embed_folder(
            ns.checkpoint, ns.images, ns.output, batch_size=ns.batch_size,
            num_workers=ns.num_workers, devices=ns.devices, prefix=ns.prefix,
            on_error=ns.on_error, patch_features=ns.patch_features,
            **preprocessing_overrides(ns))
    except (ValueError, OSError, CorruptImageError, ImportError) as err:
        parser.exit(2, f"embed: error: {err}\n")
    size = "x".join(map(str, result["shape"]))
    print(f"Wrote {result['rows']} embeddings of size {size} to {ns.output}.")
    if result["skipped"]:
        print(f"Skipped {len(result['skipped'])} unreadable images, listed in "
              f"{ns.output}.skipped.txt.")
    return result


