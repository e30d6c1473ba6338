"""A first-in-first-out queue of embeddings: the dictionary of negatives of MoCo.

He et al., "Momentum Contrast for Unsupervised Visual Representation Learning", CVPR 2020, §3.2:
the keys of the current mini-batch are enqueued and the oldest ones dequeued, which decouples
the number of negatives from the batch size. The queue and its pointer are persistent buffers,
so they travel with the method's checkpoint and resume exactly.

Under DDP the caller enqueues the keys gathered from every rank (rank-major order) so that all
ranks hold the same queue. The same queue is NNCLR's support set (:meth:`FeatureQueue.nearest`,
All4One's :meth:`FeatureQueue.top_k`)
and NT-Xent's memory bank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FeatureQueue(nn.Module):
    """Ring buffer of ``size`` embeddings of dimension ``dim``.

    Args:
        size: Number of stored embeddings (65536 for ImageNet, 4096 for CIFAR in MoCo v2). Must
            be a multiple of the number of embeddings enqueued per step (the global batch).
        dim: Embedding size.
        seed: Seed of the initial random unit vectors (the same on every rank, so the queue is
            identical across ranks before it has been filled).
    """

    queue: Tensor
    queue_ptr: Tensor

    def __init__(self, size: int, dim: int, seed: int = 0) -> None:
        super().__init__()
        if size <= 0:
            raise ValueError(f"FeatureQueue size must be > 0, got {size}.")
        if dim <= 0:
            raise ValueError(f"FeatureQueue dim must be > 0, got {dim}.")
        generator = torch.Generator().manual_seed(seed)
        initial = F.normalize(torch.randn(size, dim, generator=generator), dim=1)
        self.register_buffer("queue", initial)
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    @property
    def size(self) -> int:
        return self.queue.shape[0]

    def negatives(self) -> Tensor:
        """A copy of the stored embeddings (a copy, because :meth:`enqueue` then writes in place
        while autograd may still hold the old values for the backward pass)."""
        return self.queue.clone()

    @torch.no_grad()
    def top_k(self, query: Tensor, k: int) -> Tensor:
        """For each row of ``query`` (N, D), copies of the ``k`` stored embeddings with the
        highest cosine similarity, most similar first, (N, k, D) (All4One's neighbour sets)."""
        if query.dim() != 2 or query.shape[1:] != self.queue.shape[1:]:
            raise ValueError(f"Queries of shape {tuple(query.shape)} do not fit a queue of "
                             f"{tuple(self.queue.shape)}.")
        if not 1 <= k <= self.size:
            raise ValueError(f"k must be in [1, {self.size}] (the queue size), got {k}.")
        dtype = torch.promote_types(query.dtype, self.queue.dtype)  # not bf16 under autocast
        with torch.autocast(device_type=query.device.type, enabled=False):
            stored = F.normalize(self.queue.to(dtype), dim=1)
            similarity = F.normalize(query.to(dtype), dim=1) @ stored.T
            index = similarity.argmax(dim=1, keepdim=True) if k == 1 else similarity.topk(
                k, dim=1).indices
        return self.queue[index].clone()

    @torch.no_grad()
    def nearest(self, query: Tensor) -> Tensor:
        """For each row of ``query`` (N, D), a copy of the stored embedding with the highest cosine
        similarity (the nearest neighbour on the unit sphere; NNCLR's ``NN(z, Q)``), (N, D)."""
        return self.top_k(query, 1)[:, 0]

    @torch.no_grad()
    def enqueue(self, keys: Tensor) -> None:
        """Overwrite the oldest ``len(keys)`` rows with ``keys`` and advance the pointer.

        Raises:
            ValueError: if the queue size is not a multiple of ``len(keys)``.
        """
        n = keys.shape[0]
        if n == 0 or self.size % n != 0:
            raise ValueError(
                f"The queue size {self.size} must be a multiple of the number of keys enqueued "
                f"per step, {n} (per-device batch × world size); change the queue size or the "
                "batch size, and use drop_last=True so the last batch is not smaller."
            )
        if keys.shape[1:] != self.queue.shape[1:]:
            raise ValueError(f"Keys of shape {tuple(keys.shape)} do not fit a queue of "
                             f"{tuple(self.queue.shape)}.")
        ptr = int(self.queue_ptr)
        self.queue[ptr : ptr + n] = keys.detach().to(self.queue.dtype)
        self.queue_ptr.fill_((ptr + n) % self.size)
