"""``python -m ssl_lightning channel-stats --images DIR``: the per-channel mean and standard
deviation of a folder of images, printed as the ``mean:`` / ``std:`` lines of
``MultiChannelViews`` and ``MultiChannelEval`` in a config; ``--output stats.yaml`` also writes
them as a config piece that a pre-training config composes. Every user error (a missing or
empty folder, a bad ``--limit``, an unreadable or non-finite image, mixed channel counts or bit
depths, an existing ``--output``) is one ``error:`` line and exit status 2."""

from __future__ import annotations

import argparse
import os

import torch

from ssl_lightning.cli.errors import debug_mode, one_line
from ssl_lightning.data.channel_stats import channel_statistics, write_config_piece
from ssl_lightning.data.datasets import CorruptImageError, check_directory
from ssl_lightning.data.indexing import ARRAY_EXTENSIONS, find_images


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
