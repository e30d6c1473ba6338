"""Images/s of the streaming path (litdata shards, ``StreamingDataModule``) vs the ImageFolder
path (``ImageFolderDataModule``) on the same CIFAR-10 JPEGs, one CPU core, side by side.

Both modules run their real training loader in the main process (``num_workers=0``, one
torch thread), seeded order, batch ``--batch``; the rounds alternate between the two paths and
the median of ``--rounds`` is reported, with the ratio streaming / folder. Two pipelines:

- ``decode``: the sample read and decoded to a uint8 tensor (``UInt8Image``), no augmentation,
  which isolates what the two paths do differently (a file open per image vs a read from a
  memory-mapped shard);
- ``simclr``: the per-image 2-view ``SimCLRViews("cifar")`` of ``configs/simclr.yaml``'s
  per-image path.

Files are in the page cache after the first round (both paths); the shard command's time is
reported too.

Usage (extract the JPEGs first: ``tar -xzf /work/shared/data/cifar10-jpeg.tar.gz -C /tmp/cifar``):
    python benchmarks/streaming_throughput.py --images /tmp/cifar/cifar10/test --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ssl_lightning.data import (
    ImageFolderDataModule,
    SimCLRViews,
    SSLDataModule,
    StreamingDataModule,
    UInt8Image,
)
from ssl_lightning.data.shards import write_shards


def images_per_second(module: SSLDataModule, batches: int) -> float:
    """Training batches of ``module`` read for ``batches`` steps (or one epoch), images/s."""
    loader = module.train_dataloader()
    start, seen = time.perf_counter(), 0
    for step, (views, _, _) in enumerate(loader):
        seen += views[0].shape[0]
        if step + 1 == batches:
            break
    return seen / (time.perf_counter() - start)


def build(path: str, images: str, shards: str, transform: Any, batch: int) -> SSLDataModule:
    """The ``"folder"`` or ``"streaming"`` data module of the same images."""
    common: dict[str, Any] = dict(preset="cifar", batch_size=batch, num_workers=0, seed=0,
                                  train_transform=transform)
    if path == "folder":
        return ImageFolderDataModule(images, **common)
    return StreamingDataModule(shards, **common)


def measure(images: str, batch: int = 256, batches: int = 20, rounds: int = 3,
            shards: str | None = None) -> dict[str, Any]:
    """Images/s of both paths for both pipelines (medians of ``rounds`` alternating rounds),
    and the shard command's figures; shards in ``shards`` or a temporary folder."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(shards or Path(temp) / "shards")
        start = time.perf_counter()
        manifest = write_shards(images, folder, shard_size=1000, progress=False)
        shard_s = time.perf_counter() - start
        pipelines = {"decode": lambda: UInt8Image.for_preset("cifar"),
                     "simclr": lambda: SimCLRViews("cifar")}
        results: dict[str, Any] = {"images": images, "num_images": manifest["num_images"],
                                   "shards": len(manifest["shards"]), "shard_s": round(shard_s, 2),
                                   "batch": batch, "batches": batches}
        for name, transform in pipelines.items():
            rates: dict[str, list[float]] = {"folder": [], "streaming": []}
            for _ in range(rounds):
                for path in rates:
                    module = build(path, images, str(folder), transform(), batch)
                    rates[path].append(images_per_second(module, batches))
            folder_rate, stream = (statistics.median(rates[p]) for p in ("folder", "streaming"))
            results[name] = {"folder_img_s": folder_rate, "streaming_img_s": stream,
                             "ratio_streaming_over_folder": stream / folder_rate}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="ImageFolder of JPEGs (class folders)")
    parser.add_argument("--shards", default=None, help="shard folder (default: a temp folder)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20, help="batches per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    results = measure(options.images, options.batch, options.batches, options.rounds,
                      options.shards)
    for name in ("decode", "simclr"):
        r = results[name]
        print(f"{name:7s} folder {r['folder_img_s']:8.0f} img/s   streaming "
              f"{r['streaming_img_s']:8.0f} img/s   ratio {r['ratio_streaming_over_folder']:.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
