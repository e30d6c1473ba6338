"""Per-channel mean and standard deviation of a folder of images, for their normalisation
(:func:`channel_statistics`), and the config piece that reads multi-channel images with them
(:func:`write_config_piece`); the ``channel-stats`` command is
:mod:`ssl_lightning.cli.channel_stats`."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ssl_lightning.data.arrays import read_pixels
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
