"""Run a function in N CPU processes joined by a gloo process group (loss-level DDP tests).

``run_in_processes(fn, world_size, *args)`` spawns ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` with the default process group initialised, and returns the list
of their (picklable) return values ordered by rank. ``fn`` must be a module-level function.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_in_processes(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> list[Any]:
    """Spawn ``world_size`` gloo processes running ``fn(rank, world_size, *args)``."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), out_dir, fn, args), nprocs=world_size)
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def average_gradients_like_ddp(module: torch.nn.Module) -> None:
    """Average every parameter gradient over ranks, as DDP's reducer does."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= dist.get_world_size()


def backward_like_ddp(model: torch.nn.Module, loss: torch.Tensor, world_size: int) -> torch.Tensor:
    """``loss.backward()``; on several processes, then average the gradients as DDP's reducer
    does and return the loss averaged over ranks (what one process on the global batch reports)."""
    loss.backward()
    if world_size > 1:
        average_gradients_like_ddp(module=model)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world_size
    return loss
