"""Per-channel mean and standard deviation of a folder of images, for their normalisation:
``python -m ssl_lightning channel-stats --images DIR`` prints them as the ``mean:`` / ``std:``
lines of ``MultiChannelViews`` and ``MultiChannelEval`` in a config; ``--output stats.yaml``
also writes them as a config piece that a pre-training config composes
(:func:`write_config_piece`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from ssl_lightning.data.arrays import load_array
from ssl_lightning.data.datasets import check_directory
from ssl_lightning.data.indexing import ARRAY_EXTENSIONS, find_images
from ssl_lightning.io import atomic_open


def channel_statistics(paths: Iterable[str | Path]) -> tuple[list[float], list[float], int]:
    """Per-channel mean and (population) standard deviation over every pixel of every image,
    and the number of images. Sums in float64 of values shifted by the first image's channel
    means (the shifted-data variance: no cancellation for data far from zero, e.g. 16-bit).

    Raises:
        ValueError: no images, or images with different channel counts (naming the first).
    """
    shift = total = squares = None
    pixels, count = 0, 0
    for path in paths:
        flat = load_array(path).double().flatten(1)
        if shift is None:
            shift = flat.mean(1, keepdim=True)
            total, squares = torch.zeros_like(shift[:, 0]), torch.zeros_like(shift[:, 0])
        elif flat.shape[0] != shift.shape[0]:
            raise ValueError(f"{path} has {flat.shape[0]} channels, the images before it "
                             f"{shift.shape[0]}: one dataset needs one channel count.")
        centred = flat - shift
        total += centred.sum(1)
        squares += centred.square().sum(1)
        pixels += flat.shape[1]
        count += 1
    if shift is None or total is None or squares is None:
        raise ValueError("No images to compute channel statistics from.")
    offset = total / pixels
    std = (squares / pixels - offset.square()).clamp_min(0).sqrt()
    return (shift[:, 0] + offset).tolist(), std.tolist(), count


def main(args: list[str] | None = None) -> tuple[list[float], list[float], int]:
    """Print the statistics of ``--images`` (all of them, or ``--limit`` drawn at random)."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning channel-stats",
        description="Per-channel mean and std of the images under a folder (any channel count "
                    "and bit depth, in the files' units), printed as YAML for MultiChannelViews "
                    "and MultiChannelEval.")
    parser.add_argument("--images", required=True, help="folder of images (searched recursively)")
    parser.add_argument("--limit", type=int, default=None,
                        help="use N images drawn at random (seeded by --seed) instead of all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None,
                        help="also write them as a config piece (stats.yaml) that a "
                             "pre-training config composes: --config <method>.yaml --config "
                             "stats.yaml")
    options = parser.parse_args(args)
    if options.output is not None and os.path.exists(options.output):
        parser.exit(2, f"channel-stats: error: --output {options.output!r} exists; remove it "
                       "or name another file (it is not overwritten).\n")
    paths = find_images(check_directory(options.images), ARRAY_EXTENSIONS)
    if options.limit is not None and options.limit < len(paths):
        order = torch.randperm(len(paths), generator=torch.Generator().manual_seed(options.seed))
        paths = [paths[i] for i in sorted(order[:options.limit].tolist())]
    mean, std, count = channel_statistics(paths)
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
