"""Run a function in N CPU processes joined by a gloo process group (loss-level DDP tests).

``run_in_processes(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on each of
``world_size`` processes with the default process group initialised, and returns the list of
their (picklable) return values ordered by rank. ``fn`` must be a module-level function. The
processes are the session's :mod:`ssl_lightning.testing.process_pool` (started once, each job
from a fresh state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ssl_lightning.testing.process_pool import pool


def run_in_processes(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes, results by rank."""
    return pool(world_size).run(fn, args)


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
