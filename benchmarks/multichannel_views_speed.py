"""2-view multi-channel augmentation, images/s on one CPU core, side by side in one run:
``MultiChannelViews`` per image against ``MultiChannelDeviceViews`` batched in the loader's
collate (the two loader paths of ``image_reader: array``), both seeded per sample as the data
modules run them, file reading included.

The images are random 16-bit tiles written as ``.npy`` files to a temporary folder (``--bands``
bands of ``--size`` px), so no dataset is needed.

Usage:
    python benchmarks/multichannel_views_speed.py --images 1024 --bands 13 --size 64 --crop 48
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from views_speed import batched_seeded, per_image_seeded

from ssl_lightning.data import ArrayImage, MultiChannelDeviceViews, MultiChannelViews
from ssl_lightning.data.arrays import load_array


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--bands", type=int, default=13)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--crop", type=int, default=48)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stats = dict(mean=[30000.0] * args.bands, std=[18000.0] * args.bands, crop_size=args.crop)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for i in range(args.images):
            paths.append(str(Path(folder) / f"{i:06d}.npy"))
            np.save(paths[-1], rng.integers(0, 65536, (args.bands, args.size, args.size),
                                            dtype=np.uint16))
        pipelines = {
            "MultiChannelViews per image, seeded": per_image_seeded(
                MultiChannelViews(**stats), loader=load_array),
            f"MultiChannelDeviceViews batched on CPU ({args.batch}), seeded": batched_seeded(
                args.batch, MultiChannelDeviceViews(**stats), ArrayImage(), loader=load_array),
        }
        rates: dict[str, list[float]] = {name: [] for name in pipelines}
        for _ in range(args.rounds):  # interleaved rounds: load changes hit both pipelines
            for name, run in pipelines.items():
                start = time.perf_counter()
                rates[name].append(run(paths) / (time.perf_counter() - start))
    results = {name: statistics.median(r) for name, r in rates.items()}
    base = next(iter(results.values()))
    print(f"{args.images} images of {args.bands} x {args.size} x {args.size} uint16, "
          f"{args.crop} px views, 1 thread, median of {args.rounds} rounds")
    for name, rate in results.items():
        print(f"{name:60s} {rate:8.0f} images/s  ({rate / base:.2f}x)")


if __name__ == "__main__":
    main()
