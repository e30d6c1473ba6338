"""Lightning overhead: a SimCLR training step through our LightningModule + Trainer vs a
hand-written PyTorch loop with the same model, loss, optimiser, LR schedule and data, on CPU.

Both read the same precomputed views from a ``DataLoader`` (no workers); a step is timed from
one batch's start to the next (data fetch, forward, backward, optimiser and scheduler step, and
for Lightning its hooks, logging and closure), both in wall time and in CPU time of the process
(``time.process_time``, all threads): on a shared, loaded machine the CPU time is the fair
figure, since waiting for other processes' cores is not overhead. Lightning and the hand loop
alternate over ``--rounds`` rounds; the figures are medians over all timed steps.

Usage:
    python benchmarks/step_overhead.py --backbone small --batch 128 --steps 30 --rounds 3
    python benchmarks/step_overhead.py --backbone resnet18 --batch 64 --steps 10 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ssl_lightning.backbones import ResNet, SmallConvNet
from ssl_lightning.methods import SimCLR
from ssl_lightning.optim import WarmupCosine


class FixedViews(Dataset):
    """``n`` samples of two fixed random 32-px views and a target."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.views = torch.randn(2, n, 3, 32, 32, generator=g)

    def __len__(self) -> int:
        return self.views.shape[1]

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        return [self.views[0, i], self.views[1, i]], 0


def make_model(backbone: str) -> SimCLR:
    torch.manual_seed(0)
    net = ResNet(18, cifar_stem=True) if backbone == "resnet18" else SmallConvNet()
    return SimCLR(net, projection_hidden_dim=512, projection_dim=128, optimizer="sgd", lr=0.1,
                  lr_scaling="none", weight_decay=5e-4, warmup_epochs=0.0)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _deltas(starts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, cpu) durations between consecutive starts, skipping the first (warm-up) step."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(starts[1:-1], starts[2:], strict=True)]


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(_now())


def lightning_steps(backbone: str, loader: DataLoader, steps: int) -> list[tuple[float, float]]:
    timer = StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[timer])
    trainer.fit(make_model(backbone), train_dataloaders=loader)
    return _deltas(timer.starts)


def hand_steps(backbone: str, loader: DataLoader, steps: int) -> list[tuple[float, float]]:
    model = make_model(backbone)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(0, steps + 1, 0.0))
    starts = []
    for step, (views, _) in enumerate(loader):
        starts.append(_now())
        if step == steps + 1:
            break
        loss, _ = model.training_loss(views)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    return _deltas(starts)


def measure(backbone: str, batch: int, steps: int, rounds: int, threads: int = 1) -> dict[str, Any]:
    """Median ms per step of Lightning and the hand-written loop, alternating over ``rounds``,
    in wall and CPU time (``{clock}_ms_per_step``), and Lightning's overhead (``{clock}_overhead``,
    a fraction)."""
    torch.set_num_threads(threads)
    loader = DataLoader(FixedViews(batch * (steps + 2)), batch_size=batch, drop_last=True)
    times: dict[str, list[tuple[float, float]]] = {"lightning": [], "hand-written loop": []}
    for _ in range(rounds):
        times["hand-written loop"] += hand_steps(backbone, loader, steps)
        times["lightning"] += lightning_steps(backbone, loader, steps)
    results: dict[str, Any] = {}
    for clock, index in (("wall", 0), ("cpu", 1)):
        median = {name: statistics.median(t[index] for t in ts) for name, ts in times.items()}
        results[f"{clock}_ms_per_step"] = {k: v * 1e3 for k, v in median.items()}
        results[f"{clock}_overhead"] = median["lightning"] / median["hand-written loop"] - 1
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", choices=["small", "resnet18"], default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    results: dict[str, Any] = dict(vars(args))
    results.update(measure(args.backbone, args.batch, args.steps, args.rounds, args.threads))
    for clock in ("wall", "cpu"):
        for name, t in results[f"{clock}_ms_per_step"].items():
            print(f"{clock:4s} {name:20s} {t:8.1f} ms/step")
        print(f"{clock:4s} Lightning overhead: {results[f'{clock}_overhead'] * 100:+.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
