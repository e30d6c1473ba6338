"""Cost of one EMA teacher update: fused ``torch._foreach`` ops (``ema_update_``, what
``EMACallback`` runs) vs a per-parameter Python loop, for the BYOL ResNet-18 teacher
(backbone + 4096-wide projector), on CPU or CUDA.

Times are medians over ``--repeats`` updates (the two variants interleaved), in wall time and,
on CPU, in process CPU time (``time.process_time``), the fairer figure on a shared machine.

Usage:
    python benchmarks/ema_update.py --device cpu --repeats 30
    python benchmarks/ema_update.py --device cuda --repeats 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from ssl_lightning.backbones import ResNet
from ssl_lightning.methods import BYOL
from ssl_lightning.training.ema import ema_update_


@torch.no_grad()
def loop_update(pairs: list, tau: float) -> None:
    """The naive reference: one mul_/add_ pair of kernels per parameter."""
    for student, teacher in pairs:
        for s, t in zip(student.parameters(), teacher.parameters(), strict=True):
            t.mul_(tau).add_(s, alpha=1 - tau)
        for s, t in zip(student.buffers(), teacher.buffers(), strict=True):
            t.copy_(s)


def timed(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device
          ) -> dict[str, dict[str, float]]:
    """Median wall / CPU milliseconds of each function, calls interleaved round by round so that
    the load of a shared machine hits all of them alike."""
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: {"wall_ms": 1e3 * statistics.median(walls[name]),
                   "cpu_ms": 1e3 * statistics.median(cpus[name])} for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = BYOL(ResNet(18, cifar_stem=True)).to(device)
    pairs = model.ema_pairs()
    n_params = sum(p.numel() for _, t in pairs for p in t.parameters())
    n_tensors = sum(1 for _, t in pairs for _ in t.parameters())
    fns = {"foreach": lambda: ema_update_(pairs, 0.99), "loop": lambda: loop_update(pairs, 0.99)}
    for fn in fns.values():
        fn()  # warm-up
    result = {"device": str(device), "teacher_parameters": n_params,
              "teacher_tensors": n_tensors, **timed(fns, args.repeats, device)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
