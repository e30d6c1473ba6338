"""Dense vs chunked NT-Xent: forward + backward time and peak memory, side by side in one run.

Usage:
    python benchmarks/chunked_loss.py                      # CPU: time at 2x4096, memory at 2x16384
    python benchmarks/chunked_loss.py --device cuda --time-n 8192 --memory-n 8192 --dense-memory

Time: median of ``--repeats`` forward+backward passes of ``NTXentLoss`` on (N, 128) x 2 embeddings,
dense and chunked alternating in one process. Memory: each configuration runs in a fresh
subprocess; on CPU the figure is the peak RSS of the process (``VmHWM``; ``ru_maxrss`` would
include the parent's RSS inherited through fork/exec) minus the RSS after the inputs were made,
on CUDA ``max_memory_allocated`` minus the allocation before the call. The dense run at 2x16384
on CPU needs ~13 GB and only runs with ``--dense-memory``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from ssl_lightning.losses import NTXentLoss


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _inputs(n: int, dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z1 = torch.randn(n, dim, generator=g).to(device).requires_grad_()
    z2 = torch.randn(n, dim, generator=g).to(device).requires_grad_()
    return z1, z2


def time_losses(n: int, dim: int, chunk: int, repeats: int, device: str) -> dict[str, float]:
    """Median seconds of one forward+backward, dense and chunked, interleaved."""
    z1, z2 = _inputs(n, dim, device)
    losses = {"dense": NTXentLoss(0.2, chunk_size=None),
              "chunked": NTXentLoss(0.2, chunk_size=chunk)}
    times: dict[str, list[float]] = {name: [] for name in losses}
    for step in range(repeats + 1):
        for name, loss in losses.items():
            z1.grad = z2.grad = None
            _sync(device)
            start = time.perf_counter()
            loss(z1, z2).backward()
            _sync(device)
            if step > 0:  # the first round warms up allocators / kernels
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _status_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process from /proc/self/status, in MB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def peak_memory_child(mode: str, n: int, dim: int, chunk: int, device: str) -> float:
    """Run once in this (fresh) process; return the peak extra memory in MB."""
    z1, z2 = _inputs(n, dim, device)
    loss = NTXentLoss(0.2, chunk_size=None if mode == "dense" else chunk)
    if device == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss(z1, z2).backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - allocated) / 2**20
    resident = _status_mb("VmRSS")
    loss(z1, z2).backward()
    return _status_mb("VmHWM") - resident


def peak_memory(mode: str, n: int, dim: int, chunk: int, device: str, threads: int) -> float:
    cmd = [sys.executable, __file__, "--child", mode, "--memory-n", str(n), "--dim", str(dim),
           "--chunk", str(chunk), "--device", device, "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--time-n", type=int, default=4096, help="samples per view for timing")
    parser.add_argument("--memory-n", type=int, default=16384, help="samples per view, memory")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-memory", action="store_true", help="also measure dense memory")
    parser.add_argument("--child", choices=["dense", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(peak_memory_child(args.child, args.memory_n, args.dim, args.chunk, args.device))
        return
    results: dict = {"device": args.device, "threads": args.threads, "dim": args.dim,
                     "chunk": args.chunk}
    t = time_losses(args.time_n, args.dim, args.chunk, args.repeats, args.device)
    results[f"time_s_2x{args.time_n}"] = t
    results["chunked_over_dense_time"] = t["chunked"] / t["dense"]
    modes = ["chunked", "dense"] if args.dense_memory else ["chunked"]
    results[f"peak_mb_2x{args.memory_n}"] = {
        m: peak_memory(m, args.memory_n, args.dim, args.chunk, args.device, args.threads)
        for m in modes}
    n2 = 2 * args.memory_n
    results[f"dense_logits_mb_2x{args.memory_n}"] = n2 * n2 * 4 / 2**20
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
