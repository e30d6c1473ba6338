"""Per-channel mean and standard deviation of a folder of images, for their normalisation:
``python -m ssl_lightning channel-stats --images DIR`` prints them as the ``mean:`` / ``std:``
lines of ``MultiChannelViews`` and ``MultiChannelEval`` in a config; ``--output stats.yaml``
also writes them as a config piece that a pre-training config composes
(:func:`write_config_piece`). Every user error (a missing or empty folder, a bad ``--limit``, an
unreadable or non-finite image, mixed channel counts or bit depths, an existing ``--output``) is
one ``error:`` line and exit status 2."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ssl_lightning.cli.errors import debug_mode, one_line
from ssl_lightning.data.arrays import read_pixels
from ssl_lightning.data.datasets import CorruptImageError, check_directory
from ssl_lightning.data.indexing import ARRAY_EXTENSIONS, find_images
from ssl_lightning.io import atomic_open


def bit_depth(dtype: np.dtype) -> str:
    """The unit a file's pixels are in: its integer type (``uint8``, ``uint16``, ...), or
    ``float`` for any floating-point type."""
    return "float" if dtype.kind == "f" else str(dtype)


def channel_statistics(paths: Iterable[str | Path]) -> tuple[list[float], list[float], int]:
    """Per-channel mean and (population) standard deviation over every pixel of every image,
    and the number of images. Sums in float64 of values shifted by the first image's channel
    means (the shifted-data variance: no cancellation for data far from zero, e.g. 16-bit).

    Raises:
        ValueError: no images, or images with different channel counts or bit depths (naming
            a file of each).
        CorruptImageError: an image that cannot be read, holds no pixel or a non-finite value
            (:func:`~ssl_lightning.data.arrays.read_pixels`).
    """
    shift: torch.Tensor | None = None
    total = squares = torch.zeros(0)  # per channel, from the first image on
    pixels, count, first = 0, 0, ("", "")
    for path in paths:
        array = read_pixels(path)
        flat = torch.from_numpy(array.astype(np.float64)).flatten(1)
        if shift is None:
            shift = flat.mean(1, keepdim=True)
            total, squares = torch.zeros_like(shift[:, 0]), torch.zeros_like(shift[:, 0])
            first = (str(path), bit_depth(array.dtype))
        elif flat.shape[0] != shift.shape[0]:
            raise ValueError(f"{path} has {flat.shape[0]} channels, the images before it "
                             f"{shift.shape[0]}: one dataset needs one channel count.")
        elif bit_depth(array.dtype) != first[1]:
            raise ValueError(
                f"{path} holds {bit_depth(array.dtype)} pixels, {first[0]} {first[1]} ones: "
                "their statistics would pool two units. Convert the files to one bit depth, or "
                "compute the statistics of each kind apart.")
        centred = flat - shift
        total += centred.sum(1)
        squares += centred.square().sum(1)
        pixels += flat.shape[1]
        count += 1
    if shift is None:
        raise ValueError("No images to compute channel statistics from.")
    offset = total / pixels
    std = (squares / pixels - offset.square()).clamp_min(0).sqrt()
    return (shift[:, 0] + offset).tolist(), std.tolist(), count


def _limit(text: str) -> int:
    """``--limit``: a whole number of images, at least 1."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def main(args: list[str] | None = None) -> tuple[list[float], list[float], int]:
    """Print the statistics of ``--images`` (all of them, or ``--limit`` drawn at random)."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning channel-stats",
        description="Per-channel mean and std of the images under a folder (any channel count "
                    "and bit depth, in the files' units), printed as YAML for MultiChannelViews "
                    "and MultiChannelEval.")
    parser.add_argument("--images", required=True, help="folder of images (searched recursively)")
    parser.add_argument("--limit", type=str, default=None,
                        help="use N >= 1 images drawn at random (seeded by --seed) instead of all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None,
                        help="also write them as a config piece (stats.yaml) that a "
                             "pre-training config composes: --config <method>.yaml --config "
                             "stats.yaml")
    options = parser.parse_args(args)
    if options.output is not None and os.path.exists(options.output):
        parser.exit(2, f"error: --output {options.output!r} exists; remove it or name another "
                       "file (it is not overwritten).\n")
    try:
        limit = None if options.limit is None else _limit(options.limit)
    except ValueError:
        parser.exit(2, f"error: --limit must be a whole number of images >= 1, got "
                       f"{options.limit!r}; leave it out to use every image.\n")
    try:
        paths = find_images(check_directory(options.images), ARRAY_EXTENSIONS)
        if not paths:
            raise ValueError(f"no images under {options.images} (searched recursively for "
                             f"{', '.join(ARRAY_EXTENSIONS)}).")
        if limit is not None and limit < len(paths):
            generator = torch.Generator().manual_seed(options.seed)
            order = torch.randperm(len(paths), generator=generator)
            paths = [paths[i] for i in sorted(order[:limit].tolist())]
        mean, std, count = channel_statistics(paths)
    except (ValueError, OSError, CorruptImageError) as err:
        if debug_mode():
            raise
        parser.exit(2, f"error: {one_line(err)}\n")
    print(f"# {len(mean)} channel(s), {count} image(s) under {options.images}")
    print(f"mean: [{', '.join(f'{v:.6g}' for v in mean)}]")
    print(f"std: [{', '.join(f'{v:.6g}' for v in std)}]")
    if options.output is not None:
        write_config_piece(options.output, mean, std, f"{count} image(s) under {options.images}")
        print(f"Wrote {options.output}: compose it after the method's config "
              f"(--config <method>.yaml --config {options.output}).")
    return mean, std, count


def write_config_piece(output: str | Path, mean: list[float], std: list[float],
                       source: str) -> None:
    """Write (atomically) the data section that reads multi-channel images with these
    statistics: ``ImageFolderDataModule`` with ``image_reader: array``, ``MultiChannelViews``
    and ``MultiChannelEval`` (crop sizes and folders are left to the other configs or flags)."""
    import yaml

    statistics = {"mean": [float(v) for v in mean], "std": [float(v) for v in std]}
    piece = {"data": {"class_path": "ImageFolderDataModule", "init_args": {
        "image_reader": "array", "device_transform": None,
        "train_transform": {"class_path": "MultiChannelViews", "init_args": statistics},
        "eval_transform": {"class_path": "MultiChannelEval", "init_args": statistics}}}}
    with atomic_open(output, "w", encoding="utf-8") as handle:
        handle.write(f"# Per-channel statistics of {source} (python -m ssl_lightning "
                     "channel-stats).\n# Compose after a method's config: --config <method>.yaml "
                     "--config this.yaml --data.train_dir DIR\n# (crop sizes: "
                     "--data.train_transform.init_args.crop_size N, the same for eval_transform)."
                     "\n")
        yaml.safe_dump(piece, handle, sort_keys=False, default_flow_style=None)
