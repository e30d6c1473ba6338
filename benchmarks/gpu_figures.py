"""GPU figures in one short run: SimCLR ResNet-18 CIFAR-10 throughput, the NT-Xent kernel dense vs
chunked, and a few-step mixed-precision ``Trainer`` fit of every method class.

    PYTHONPATH=. python3 benchmarks/gpu_figures.py --out $OUT      # on the GPU machine
    PYTHONPATH=. python benchmarks/gpu_figures.py --smoke --out /tmp/figs   # CPU, tiny sizes

Sections (each writes ``gpu_figures.json`` as soon as it finishes; a section that would start
after ``--deadline-s`` is skipped, and each measurement is in try/except so a failure is recorded
and does not hide the rest):

1. NT-Xent forward+backward on 2 x 8192 x 128 fp32: dense vs chunked time (median, CUDA-synced)
   and peak extra memory (``max_memory_allocated``).
2. SimCLR, ResNet-18 with the CIFAR stem, synthetic uint8 32-px images, batch 512, through
   ``Trainer.fit``: images/s for fp32 / bf16-mixed / 16-mixed, channels_last, with the views
   made on the GPU by ``DeviceViews`` or without augmentation (uint8 -> float only).
3. ``DeviceViews`` alone: 2 views of 512 images on the GPU, images/s.
4. Every method class in ``ssl_lightning.methods``: 3 ``Trainer.fit`` steps in bf16-mixed and
   16-mixed, loss finite.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import Dataset

import ssl_lightning.methods as methods
from ssl_lightning.backbones import ResNet, SmallConvNet
from ssl_lightning.data import DeviceViews, SSLDataModule
from ssl_lightning.losses import NTXentLoss

sys.path.insert(0, os.path.dirname(__file__))
from chunked_loss import time_losses  # noqa: E402

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class RandomUInt8(Dataset):
    """``n`` fixed random uint8 images (3, size, size), target -1."""

    def __init__(self, n: int, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[list[Tensor], int]:
        return [self.images[i]], -1


class NoAugmentation:
    """uint8 -> 2 normalised float views (the image and its mirror): the model-only baseline."""

    def __call__(self, images: Tensor) -> list[Tensor]:
        mean = torch.tensor(CIFAR_MEAN, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD, device=images.device).view(1, 3, 1, 1)
        x = (images.float() / 255 - mean) / std
        return [x, x.flip(-1)]


class SyntheticData(SSLDataModule):
    """Synthetic uint8 images; views made after the transfer by ``device_transform``."""

    def __init__(self, n: int, size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n, self.size = n, size

    def build_train(self, transform: Any) -> Dataset:
        return RandomUInt8(self.n, self.size)

    def build_eval(self, transform: Any) -> None:
        return None


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())


def fit(model: pl.LightningModule, transform: Callable, batch: int, steps: int, precision: Any,
        accelerator: str, workers: int) -> tuple[list[float], float]:
    """``steps`` training steps; returns (step times after the first 3, last logged loss)."""
    data = SyntheticData(batch * (steps + 1), 32, batch_size=batch, num_workers=workers,
                         device_transform=transform)  # type: ignore[arg-type]
    timer = StepTimer()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision,
                         max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, benchmark=True,
                         callbacks=[timer])
    trainer.fit(model, datamodule=data)
    times = [b - a for a, b in zip(timer.starts[3:-1], timer.starts[4:], strict=True)]
    return times, float(trainer.callback_metrics["train/loss"])


def nt_xent_figures(args: argparse.Namespace) -> dict:
    n, device = args.loss_n, args.device
    out: dict[str, Any] = {"shape": f"2x{n}x128 fp32",
                           "time_s": time_losses(n, 128, 1024, args.repeats, device)}
    for mode, chunk in [("dense", None), ("chunked_1024", 1024), ("chunked_4096", 4096)]:
        g = torch.Generator().manual_seed(0)
        z1 = torch.randn(n, 128, generator=g).to(device).requires_grad_()
        z2 = torch.randn(n, 128, generator=g).to(device).requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        NTXentLoss(0.2, chunk_size=chunk)(z1, z2).backward()
        if device == "cuda":
            torch.cuda.synchronize()
            out[f"peak_extra_mb_{mode}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del z1, z2
    if device == "cuda":
        out["time_s"]["chunked_4096"] = time_losses(n, 128, 4096, args.repeats, device)["chunked"]
    return out


def simclr_figures(args: argparse.Namespace) -> dict:
    configs = [("32-true", False, "device_views"), ("bf16-mixed", False, "device_views"),
               ("bf16-mixed", True, "device_views"), ("bf16-mixed", True, "no_augmentation"),
               ("16-mixed", True, "device_views")]
    out = {}
    for precision, channels_last, views in configs:
        key = f"{precision}{' channels_last' if channels_last else ''} {views}"
        try:
            torch.manual_seed(0)
            backbone = ResNet(18, cifar_stem=True) if not args.smoke else SmallConvNet((8, 16))
            model = methods.SimCLR(backbone, projection_hidden_dim=512, optimizer="lars",
                                   lr_scaling="none", warmup_epochs=0, channels_last=channels_last)
            transform = DeviceViews("cifar") if views == "device_views" else NoAugmentation()
            times, loss = fit(model, transform, args.batch, args.steps, precision,
                              args.accelerator, args.workers)
            step = statistics.median(times)
            out[key] = {"images_per_s": args.batch / step, "ms_per_step": step * 1e3,
                        "loss": loss, "steps_timed": len(times)}
        except Exception as err:  # record and go on
            out[key] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
        print(key, out[key], flush=True)
    return out


def device_views_figures(args: argparse.Namespace) -> dict:
    images = torch.randint(0, 256, (args.batch, 3, 32, 32), dtype=torch.uint8).to(args.device)
    views = DeviceViews("cifar")
    times = []
    for _ in range(args.repeats + 2):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        views(images)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"batch": args.batch, "images_per_s_2_views": args.batch / statistics.median(times[2:])}


def method_classes() -> list[str]:
    names = []
    for name in methods.__all__:
        cls = getattr(methods, name)
        if inspect.isclass(cls) and issubclass(cls, methods.SSLMethod) and \
                cls.training_loss is not methods.SSLMethod.training_loss:
            names.append(name)
    return names


def method_figures(args: argparse.Namespace, deadline: float) -> dict:
    out: dict[str, Any] = {}
    for precision in ("bf16-mixed", "16-mixed"):
        for name in method_classes():
            key = f"{name} {precision}"
            if time.time() > deadline:
                out[key] = {"skipped": "deadline"}
                continue
            try:
                torch.manual_seed(0)
                backbone = ResNet(18, cifar_stem=True) if not args.smoke else SmallConvNet((8, 16))
                model = getattr(methods, name)(backbone, lr_scaling="none", warmup_epochs=0)
                start = time.perf_counter()
                _, loss = fit(model, DeviceViews("cifar"), args.method_batch, 3, precision,
                              args.accelerator, args.workers)
                out[key] = {"loss": loss, "finite": math.isfinite(loss),
                            "wall_s": time.perf_counter() - start}
            except Exception as err:
                out[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                traceback.print_exc()
            print(key, out[key], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    parser.add_argument("--deadline-s", type=float, default=300.0)
    args = parser.parse_args()
    start = time.time()
    deadline = start + args.deadline_s
    cuda = torch.cuda.is_available() and not args.smoke
    args.device, args.accelerator = ("cuda", "gpu") if cuda else ("cpu", "cpu")
    args.loss_n, args.batch, args.steps, args.repeats = (8192, 512, 20, 5) if cuda else \
        (256, 16, 6, 2)
    args.method_batch, args.workers = (128, 6) if cuda else (8, 0)
    torch.set_float32_matmul_precision("highest")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "lightning": pl.__version__,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_figures.json")
    sections: list[tuple[str, Callable[[], dict]]] = [
        ("nt_xent", lambda: nt_xent_figures(args)),
        ("simclr_resnet18_cifar", lambda: simclr_figures(args)),
        ("device_views", lambda: device_views_figures(args)),
        ("methods_fit", lambda: method_figures(args, deadline)),
    ]
    for name, section in sections:
        if time.time() > deadline:
            results[name] = {"skipped": "deadline"}
            continue
        t0 = time.time()
        try:
            results[name] = section()
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
        results[f"{name}_wall_s"] = time.time() - t0
        print(name, json.dumps(results[name], indent=1), flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
    print(f"total {time.time() - start:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
