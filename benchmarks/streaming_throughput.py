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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="ImageFolder of JPEGs (class folders)")
    parser.add_argument("--shards", default=None, help="shard folder (default: a temp folder)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20, help="batches per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as temp:
        shards = Path(options.shards or Path(temp) / "shards")
        start = time.perf_counter()
        manifest = write_shards(options.images, shards, shard_size=1000, progress=False)
        shard_s = time.perf_counter() - start
        pipelines = {"decode": lambda: UInt8Image.for_preset("cifar"),
                     "simclr": lambda: SimCLRViews("cifar")}
        results: dict[str, Any] = {"images": options.images, "num_images": manifest["num_images"],
                                   "shards": len(manifest["shards"]), "shard_s": round(shard_s, 2),
                                   "batch": options.batch, "batches": options.batches}
        for name, transform in pipelines.items():
            rates: dict[str, list[float]] = {"folder": [], "streaming": []}
            for _ in range(options.rounds):
                for path in rates:
                    module = build(path, options.images, str(shards), transform(), options.batch)
                    rates[path].append(images_per_second(module, options.batches))
            folder, stream = (statistics.median(rates[p]) for p in ("folder", "streaming"))
            results[name] = {"folder_img_s": round(folder), "streaming_img_s": round(stream),
                             "ratio_streaming_over_folder": round(stream / folder, 3)}
            print(f"{name:7s} folder {folder:8.0f} img/s   streaming {stream:8.0f} img/s   "
                  f"ratio {stream / folder:.3f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
