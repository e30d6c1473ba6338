"""The one place that knows about ranks and cross-process gathering.

Methods gather through Lightning (``self.all_gather(x, sync_grads=True)``) and reshape with
:func:`flatten_gathered`; code outside Lightning (a user's own loop, the loss-level DDP tests)
uses :func:`all_gather_with_grad`. Both keep the full gradient: the backward of an all-gather
sums, over ranks, the gradient that flowed into this rank's slice, so that with DDP's gradient
averaging every rank ends up with the gradient of the *mean of the rank losses*.

Importing this module registers :func:`destroy_process_group_at_exit` with ``atexit``.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch import Tensor


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group, if one is initialised, before the interpreter exits.

    Lightning does this at exit for NCCL only; a gloo group left to the interpreter's shutdown
    destroys its threads too late, and a finished 2-process run can then abort at exit
    ("terminate called without an active exception", SIGABRT).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(destroy_process_group_at_exit)


def is_distributed() -> bool:
    """True when a default process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes in the default group (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def flatten_gathered(gathered: Tensor, local: Tensor) -> Tensor:
    """Reshape the output of ``LightningModule.all_gather`` to ``(world * B, ...)``.

    Lightning returns ``(world, B, ...)`` under DDP and the input unchanged on one device.

    Args:
        gathered: The result of ``all_gather(local)``.
        local: The tensor that was gathered (used to tell the two cases apart).
    """
    if gathered.dim() == local.dim() + 1:
        return gathered.flatten(0, 1)
    return gathered


def sampler_order(gathered: Tensor, world: int) -> Tensor:
    """The rows of a rank-major gathered batch ``(world * B, ...)`` in the global batch's
    sampler order: ``DistributedSampler`` gives rank r the positions r, r + W, ... of its order,
    so position ``j * W + r`` holds rank r's j-th sample, as a 1-process run with that order
    sees it. Decisions that depend on a sample's place in the batch (sub-batches, enqueue
    order) take it from here, so an N-process run and a 1-process run agree."""
    return gathered.unflatten(0, (world, -1)).transpose(0, 1).flatten(0, 1)


def contiguous_grad(x: Tensor) -> Tensor:
    """``x``, with the gradient that reaches it made contiguous in the backward pass.

    torch's differentiable ``all_gather`` passes the slices of its output's gradient to an
    all-to-all, which on gloo reads non-contiguous (transposed or expanded, e.g. from a
    ``mean``'s backward) tensors in the wrong order and returns wrong gradients; the gathered
    result goes through this first.
    """
    if x.requires_grad:
        x.register_hook(lambda grad: grad.contiguous())
    return x


def all_gather_with_grad(x: Tensor) -> Tensor:
    """Concatenate ``x`` from every rank along dim 0, differentiably.

    Without a process group this is the identity. All ranks must pass the same shape.
    """
    if not is_distributed():
        return x
    from torch.distributed.nn.functional import all_gather

    return contiguous_grad(torch.cat(all_gather(x), dim=0))


@torch.no_grad()
def all_gather_no_grad(x: Tensor) -> Tensor:
    """Concatenate ``x`` from every rank along dim 0, outside autograd (queues, kNN banks)."""
    if not is_distributed():
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out, dim=0)


def all_reduce_sum_with_grad(x: Tensor) -> Tensor:
    """Sum ``x`` over ranks with an autograd-aware collective.

    Use this for statistics shared across ranks that stay in the graph (VICReg covariance, Barlow
    Twins cross-correlation, SwAV Sinkhorn sums). A plain ``dist.all_reduce`` on such a tensor
    would keep only the local contribution in the backward pass and silently scale the gradient
    by ``1 / world_size``.
    """
    if not is_distributed():
        return x
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(x, op=dist.ReduceOp.SUM)


@torch.no_grad()
def all_reduce_sum_no_grad(x: Tensor) -> Tensor:
    """Sum ``x`` over ranks outside autograd (SwAV Sinkhorn normalisers)."""
    if not is_distributed():
        return x
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y


@torch.no_grad()
def all_reduce_mean_no_grad(x: Tensor) -> Tensor:
    """Average ``x`` over ranks outside autograd (DINO centre, metrics)."""
    if not is_distributed():
        return x
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y / dist.get_world_size()
