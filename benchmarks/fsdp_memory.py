"""Per-process memory of sharded (FSDP2) training on CPU: 1, 2 and 4 gloo processes.

DINO (student + EMA teacher) with a ViT-S/4 (width 384, 12 blocks, 6 heads; 2 x 24M
parameters with the heads) on 32 px views, AdamW, fitted a few steps through the CLI's strategy
(:class:`ssl_lightning.distributed.sharding.ShardedStrategy`) and Lightning's Trainer. Each
process reports the bytes it holds of parameters (student and teacher), gradients and AdamW
state (its local shards), its peak resident set size (``ru_maxrss``: activations, buffers, the
Python / torch baseline) and the seconds per step; with and without activation checkpointing of the
blocks.

    python benchmarks/fsdp_memory.py                      # 1, 2, 4 processes, both settings
    python benchmarks/fsdp_memory.py --processes 2 --steps 3 --batch-size 16
    python benchmarks/fsdp_memory.py --processes 1 --threads 1 --steps 6 --repeats 3

With both settings (the default) the two runs of each process count alternate ``--repeats``
times and a second table puts them side by side: the median seconds per step and peak RSS
with checkpointing off and on, and their ratios (on / off), so machine load that drifts during
the run hits both alike.

The global batch is the same for every process count (``--batch-size`` per process x 4 / N), so
only the sharding changes. Numbers in README.md ("Sharded training").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

from ssl_lightning.backbones import ViT
from ssl_lightning.distributed.sharding import ShardedStrategy, local_tensor
from ssl_lightning.methods import DINO

MiB = 2**20


class _Views(Dataset):
    """Random 2-view samples (content is irrelevant to memory and time)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        g = torch.Generator().manual_seed(i)
        return [torch.randn(3, self.size, self.size, generator=g) for _ in range(2)], 0


class _Meter(pl.Callback):
    """Times the steps after the first and counts the local bytes before the last step ends."""

    def __init__(self) -> None:
        self.started = 0.0
        self.bytes: dict[str, int] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            self.started = time.perf_counter()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        def size(tensors: Any) -> int:
            return sum(local_tensor(t).numel() * t.element_size() for t in tensors)

        params = list(pl_module.parameters())
        self.bytes = {"params": size(params),
                      "grads": size(p.grad for p in params if p.grad is not None)}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.bytes["adamw"] = sum(local_tensor(v).numel() * v.element_size()
                                  for state in optimizer.state.values()
                                  for v in state.values() if torch.is_tensor(v) and v.dim())
        self.seconds = (time.perf_counter() - self.started) / max(trainer.global_step - 1, 1)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    vit = ViT(image_size=args.image_size, patch_size=4, embed_dim=384, depth=12, num_heads=6)
    model = DINO(vit, head_out_dim=4096, head_hidden_dim=1024, head_bottleneck_dim=256,
                 optimizer="adamw", lr=1e-4, lr_scaling="none", warmup_epochs=0,
                 image_size=args.image_size)
    batch = args.batch_size * 4 // world
    meter = _Meter()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=ShardedStrategy(activation_checkpointing=args.checkpointing),
        callbacks=[meter])
    loader = DataLoader(_Views(batch * world * args.steps, args.image_size), batch_size=batch,
                        drop_last=True)
    trainer.fit(model, loader)
    result = {**{k: v / MiB for k, v in meter.bytes.items()}, "s_per_step": meter.seconds,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict[str, float]:
    """Rank 0's figures (every rank holds the same share) of one run with ``world`` processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, port, args, out), nprocs=world)
        with open(os.path.join(out, "rank0.json")) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="per process at 4 processes (the global batch is 4x this)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--checkpointing", choices=["off", "on", "both"], default="both")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternating runs of each setting (medians are reported)")
    args = parser.parse_args()
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    print("| processes | activation ckpt | params MiB | grads MiB | AdamW MiB | sum MiB | "
          "peak RSS MiB | s/step |")
    print("|---|---|---|---|---|---|---|---|")
    paired: list[tuple[int, dict[bool, list[dict[str, float]]]]] = []
    for world in args.processes:
        runs: dict[bool, list[dict[str, float]]] = {c: [] for c in settings}
        for _ in range(args.repeats):
            for checkpointing in settings:
                args.checkpointing = checkpointing
                r = measure(world, args)
                runs[checkpointing].append(r)
                total = r["params"] + r["grads"] + r["adamw"]
                print(f"| {world} | {'on' if checkpointing else 'off'} | {r['params']:.0f} | "
                      f"{r['grads']:.0f} | {r['adamw']:.0f} | {total:.0f} | "
                      f"{r['peak_rss']:.0f} | {r['s_per_step']:.2f} |", flush=True)
        paired.append((world, runs))
    if len(settings) == 2:
        print(f"\nActivation checkpointing side by side (medians of {args.repeats}, "
              f"{args.threads} thread(s) per process):\n")
        print("| processes | s/step off | s/step on | time on/off | peak RSS MiB off | "
              "peak RSS MiB on | RSS on/off |")
        print("|---|---|---|---|---|---|---|")
        for world, runs in paired:
            t_off, t_on = (_median(runs[c], "s_per_step") for c in (False, True))
            m_off, m_on = (_median(runs[c], "peak_rss") for c in (False, True))
            print(f"| {world} | {t_off:.2f} | {t_on:.2f} | {t_on / t_off:.2f} | {m_off:.0f} | "
                  f"{m_on:.0f} | {m_on / m_off:.2f} |", flush=True)


def _median(runs: list[dict[str, float]], key: str) -> float:
    values = sorted(r[key] for r in runs)
    return values[len(values) // 2]


if __name__ == "__main__":
    main()
