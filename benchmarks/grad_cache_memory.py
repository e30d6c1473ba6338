"""Peak memory and time of one SimCLR training step with and without gradient caching (CPU).

    python benchmarks/grad_cache_memory.py [--batch-size 512] [--micro-batch-size 64]

SimCLR with a ResNet-18 (CIFAR stem) on 32 px views; one step = loss, backward and an SGD step.
Each variant runs in its own subprocess, which reports the growth of its peak resident set
(``VmHWM``) during the step over the peak before it (model, optimizer state, views, a warm-up
step on 2 samples): the activation memory of the step. Prints both and the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from ssl_lightning.backbones import ResNet
from ssl_lightning.methods import SimCLR
from ssl_lightning.training.grad_cache import grad_cached_loss


def peak_rss_mb() -> float:
    """This process's peak resident set size (``VmHWM``) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status (Linux only).")


def one_step(batch_size: int, micro_batch_size: int | None, threads: int) -> dict[str, float]:
    """Build the model, warm up, then time one step; return peak-RSS growth and seconds."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = SimCLR(ResNet(18, cifar_stem=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    views = [torch.randn(batch_size, 3, 32, 32) for _ in range(2)]

    def step(views: list[torch.Tensor]) -> None:
        optimizer.zero_grad()
        if micro_batch_size is None or micro_batch_size >= len(views[0]):
            loss, _ = model.training_loss(views)
        else:
            loss, _ = grad_cached_loss(model, views, micro_batch_size)
        loss.backward()
        optimizer.step()

    step([v[:2] for v in views])  # gradients and momentum buffers exist from here on
    before = peak_rss_mb()
    start = time.perf_counter()
    step(views)
    return {"seconds": time.perf_counter() - start, "peak_growth_mb": peak_rss_mb() - before,
            "baseline_mb": before}


def measure(batch_size: int, micro_batch_size: int,
            threads: int = 1) -> dict[str, dict[str, float]]:
    """:func:`one_step` of the whole batch and of micro-batches, each in its own subprocess."""
    results = {}
    for variant in ("whole", "micro"):
        child = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--batch-size", str(batch_size),
             "--micro-batch-size", str(micro_batch_size), "--threads", str(threads)],
            check=True, capture_output=True, text=True,
        )
        results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", choices=["whole", "micro"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:  # a child: one variant, JSON on stdout
        micro = args.micro_batch_size if args.variant == "micro" else None
        print(json.dumps(one_step(args.batch_size, micro, args.threads)))
        return
    results = measure(args.batch_size, args.micro_batch_size, args.threads)
    for variant, r in results.items():
        print(f"{variant:>5}: peak RSS +{r['peak_growth_mb']:.0f} MB over {r['baseline_mb']:.0f} "
              f"MB, step {r['seconds']:.1f} s", flush=True)
    whole, micro = results["whole"], results["micro"]
    print(f"SimCLR ResNet-18 (CIFAR stem, 32 px), batch {args.batch_size}, micro-batch "
          f"{args.micro_batch_size}, {args.threads} thread(s): activation memory "
          f"{micro['peak_growth_mb'] / whole['peak_growth_mb']:.3f}x, step time "
          f"{micro['seconds'] / whole['seconds']:.2f}x")


if __name__ == "__main__":
    main()
