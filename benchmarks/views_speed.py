"""2-view SimCLR augmentation on CIFAR-10 JPEGs, images/s on one CPU core, side by side:

- ``lightly``: ``lightly.transforms.SimCLRTransform`` (CIFAR settings: 32 px, colour strength 0.5,
  no blur, CIFAR normalisation), per image;
- ``SimCLRViews``: ours, per image (the loader workers' path with ``train_transform:
  SimCLRViews``);
- ``DeviceViews (CPU)``: ours, decode per image to uint8 (:class:`UInt8Image`), then the batched
  augmentation of :class:`DeviceViews` on the CPU, ``--batch`` images per call (the same code runs
  on the GPU in ``on_after_batch_transfer``, or in the loader workers' collate on CPU).
- ``seeded``: the same pipelines as the data modules run them for exact resume:
  per image through :class:`SeededDataset` (the global RNG seeded per sample and per view, and
  restored); batched through ``SeededDataset`` (which adds each sample's seed) and the loader's
  :class:`BatchedViewsCollate` (counter-based draws from per-sample seeds), i.e. exactly what a
  CPU loader worker runs with ``device_transform: DeviceViews``. The ratio seeded / unseeded is
  the cost of making augmentations a pure function of (seed, epoch, index, view).

Every pipeline includes the JPEG decode and returns 2 normalised float views per image. Rates
are per CPU second (the process' user + system time, steadier on a shared machine) and per wall
second.

Usage:
    python benchmarks/views_speed.py --root /work/data/cifar10 --images 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from ssl_lightning.data import DeviceViews, SimCLRViews, UInt8Image
from ssl_lightning.data.base import BatchedViewsCollate
from ssl_lightning.data.datasets import load_image
from ssl_lightning.data.indexing import find_images
from ssl_lightning.data.seeding import SeededDataset

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "simclr.yaml"

CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


def per_image(transform: Callable) -> Callable[[list[str]], int]:
    def run(paths: list[str]) -> int:
        for path in paths:
            views = transform(load_image(path))
            assert len(views) == 2
        return len(paths)
    return run


class Images:
    """Decoded, transformed images by index (what an image-folder dataset does)."""

    def __init__(self, paths: list[str], transform: Callable,
                 loader: Callable[[str], object] = load_image) -> None:
        self.paths, self.transform, self.loader = paths, transform, loader

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[list[torch.Tensor], int]:
        return self.transform(self.loader(self.paths[index])), 0


def per_image_seeded(transform: Callable, loader: Callable[[str], object] = load_image,
                     ) -> Callable[[list[str]], int]:
    """The per-image loader path: ``loader`` then ``transform``, seeded per sample."""
    def run(paths: list[str]) -> int:
        data = SeededDataset(Images(paths, transform, loader), seed=0)
        for index in range(len(paths)):
            views, _, _ = data[(0, index)]
            assert len(views) == 2
        return len(paths)
    return run


def batched(batch: int) -> Callable[[list[str]], int]:
    decode, views = UInt8Image(), DeviceViews("cifar")

    def run(paths: list[str]) -> int:
        for start in range(0, len(paths), batch):
            chunk = range(start, min(start + batch, len(paths)))
            images = torch.stack([decode(load_image(paths[i]))[0] for i in chunk])
            out = views(images)
            assert len(out) == 2 and out[0].shape[0] == len(images)
        return len(paths)
    return run


def batched_seeded(batch: int, views: DeviceViews | None = None, decode: Callable | None = None,
                   loader: Callable[[str], object] = load_image) -> Callable[[list[str]], int]:
    """The batched loader path: ``loader`` and ``decode`` per image, then ``views`` (default
    ``DeviceViews("cifar")``) in the loader's collate, seeded per sample."""
    collate = BatchedViewsCollate(views or DeviceViews("cifar"))

    def run(paths: list[str]) -> int:
        data = SeededDataset(Images(paths, decode or UInt8Image(), loader), seed=0)
        for start in range(0, len(paths), batch):
            items = [data[(0, i)] for i in range(start, min(start + batch, len(paths)))]
            out, _, _ = collate(items)
            assert len(out) == 2 and out[0].shape[0] == len(items)
        return len(paths)
    return run


def configured_path() -> str:
    """``"batched"`` if configs/simclr.yaml sets a ``device_transform``, else ``"per-image"``."""
    data = yaml.safe_load(CONFIG.read_text())["data"].get("init_args", {})
    return "batched" if data.get("device_transform") else "per-image"


def measure(root: str, images: int = 2048, batch: int = 256,
            rounds: int = 3) -> dict[str, dict[str, float]]:
    """Images per CPU second and per wall second of each pipeline (medians over ``rounds``;
    within a round the pipelines take turns on each ``batch`` of images, so load changes hit
    every pipeline; CPU time is the steadier figure on a shared machine)."""
    torch.set_num_threads(1)
    all_paths = find_images(Path(root) / "train")
    step = max(1, len(all_paths) // images)
    paths = all_paths[::step][:images]  # spread over the classes
    pipelines: dict[str, Callable[[list[str]], int]] = {}
    try:
        from lightly.transforms import SimCLRTransform

        lightly = SimCLRTransform(input_size=32, cj_strength=0.5, gaussian_blur=0.0,
                                  normalize={"mean": CIFAR_MEAN, "std": CIFAR_STD})
        pipelines["lightly SimCLRTransform"] = per_image(lightly)
    except ImportError:
        print("lightly is not installed (pip install -e .[benchmark]); skipping it")
    pipelines["ours SimCLRViews"] = per_image(SimCLRViews("cifar"))
    pipelines["ours SimCLRViews seeded"] = per_image_seeded(SimCLRViews("cifar"))
    pipelines[f"ours DeviceViews on CPU (batch {batch})"] = batched(batch)
    pipelines[f"ours DeviceViews on CPU seeded (batch {batch})"] = batched_seeded(batch)
    cpu: dict[str, list[float]] = {name: [] for name in pipelines}
    wall: dict[str, list[float]] = {name: [] for name in pipelines}
    names = list(pipelines)
    chunks = [paths[i:i + batch] for i in range(0, len(paths), batch)]
    for _ in range(rounds):
        # Chunk by chunk, every pipeline in turn (the order rotating), so that a change of load
        # hits all pipelines alike instead of the one that happened to run then.
        seconds = {name: [0.0, 0.0] for name in names}
        for turn, chunk in enumerate(chunks):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                start, cpu_start = time.perf_counter(), time.process_time()
                pipelines[name](chunk)
                seconds[name][0] += time.process_time() - cpu_start
                seconds[name][1] += time.perf_counter() - start
        for name, (cpu_s, wall_s) in seconds.items():
            cpu[name].append(len(paths) / cpu_s)
            wall[name].append(len(paths) / wall_s)
    return {name: {"images_per_cpu_s": statistics.median(cpu[name]),
                   "images_per_s": statistics.median(wall[name])} for name in pipelines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/work/data/cifar10")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    results = measure(args.root, args.images, args.batch, args.rounds)
    default = configured_path()
    print(f"configs/simclr.yaml's loader path: {default}")
    baseline = results.get("lightly SimCLRTransform")
    for name, rate in results.items():
        ratio = (f"  ({rate['images_per_cpu_s'] / baseline['images_per_cpu_s']:.2f}x lightly)"
                 if baseline else "")
        print(f"{name:52s} {rate['images_per_cpu_s']:8.0f} images/CPU s "
              f"{rate['images_per_s']:8.0f} images/s{ratio}")
    names = list(results)
    for plain, seeded in ((names[-4], names[-3]), (names[-2], names[-1])):
        cost = 1 - results[seeded]["images_per_cpu_s"] / results[plain]["images_per_cpu_s"]
        print(f"seeding cost (CPU time), {plain}: {cost:+.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "images": args.images, "threads": 1,
                       "default_path": default}, f, indent=2)


if __name__ == "__main__":
    main()
