"""Relaxed sorting networks: a differentiable soft sort and its soft permutation matrix.

A sorting network is a fixed sequence of layers of comparators ``(i, j)``, ``i < j``, each putting
the smaller of two entries at ``i`` and the larger at ``j``. Petersen et al. ("Differentiable
Sorting Networks for Scalable Sorting and Ranking Supervision", ICML 2021) relax every
comparator with a sigmoid-shaped weight of the difference, here the Cauchy CDF (their default):

    α = arctan(β·(b − a)) / π + 1/2,   min ≈ α·a + (1 − α)·b,   max ≈ (1 − α)·a + α·b,

β the steepness (β → ∞: the hard comparator). Applying the same mixing to the columns of a
matrix that starts as the identity gives the soft permutation matrix ``P`` (n, n): ``P[k, r]``
is the weight of input ``k`` at rank ``r`` (ascending), rows and columns sum to 1, and the
relaxed sorted vector is ``x @ P``. NeCo (:mod:`ssl_lightning.losses.neco`) compares such
matrices of a student and a teacher.

Two networks: ``"bitonic"`` (Batcher; log₂(m)·(log₂(m)+1)/2 layers for m the next power of two
of n, every comparator ascending, so the comparators touching the padding entries — +∞ — are
exactly no-ops and are dropped) and ``"odd_even"`` (odd-even transposition, n layers).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

import torch
from torch import Tensor

SortingNetwork = Literal["bitonic", "odd_even"]
Layer = tuple[tuple[int, ...], tuple[int, ...]]


@lru_cache(maxsize=32)
def sorting_network(size: int, kind: SortingNetwork = "bitonic") -> tuple[Layer, ...]:
    """The layers of a sorting network for ``size`` entries, each layer ``(lower, upper)``: the
    disjoint comparators ``(lower[c], upper[c])`` applied at once."""
    if size < 1:
        raise ValueError(f"A sorting network needs at least one entry, got size={size}.")
    if kind == "odd_even":
        steps = [[(i, i + 1) for i in range(t % 2, size - 1, 2)] for t in range(size)]
        return tuple(_layer(pairs) for pairs in steps if pairs)
    if kind != "bitonic":
        raise ValueError(f"sorting network must be 'bitonic' or 'odd_even', got {kind!r}.")
    padded = 1 << max(size - 1, 0).bit_length()
    layers: list[Layer] = []
    block = 2
    while block <= padded:
        step = block // 2
        while step >= 1:
            if step == block // 2:  # the first step of a merge compares mirrored entries
                pairs = [(i, i ^ (block - 1)) for i in range(padded) if i & step == 0]
            else:
                pairs = [(i, i ^ step) for i in range(padded) if i & step == 0]
            kept = [(i, j) for i, j in pairs if j < size]
            if kept:
                layers.append(_layer(kept))
            step //= 2
        block *= 2
    return tuple(layers)


def _layer(pairs: list[tuple[int, int]]) -> Layer:
    return tuple(i for i, _ in pairs), tuple(j for _, j in pairs)


def cauchy_weight(difference: Tensor, steepness: float) -> Tensor:
    """α = arctan(β·d)/π + 1/2: the weight a relaxed comparator gives its first entry as the
    minimum, ``d`` = second − first."""
    return torch.atan(steepness * difference) / math.pi + 0.5


def soft_sort(values: Tensor, steepness: float, kind: SortingNetwork = "bitonic"
              ) -> tuple[Tensor, Tensor]:
    """Relaxed ascending sort of the last dimension of ``values`` (..., n).

    Returns:
        The relaxed sorted values (..., n) and the soft permutation matrices (..., n, n), row:
        input entry, column: rank.
    """
    if steepness <= 0:
        raise ValueError(f"steepness must be > 0, got {steepness}.")
    size = values.shape[-1]
    x = values
    perm = torch.eye(size, dtype=values.dtype, device=values.device).expand(
        *values.shape, size)
    for lower, upper in sorting_network(size, kind):
        lo = torch.tensor(lower, device=values.device)
        hi = torch.tensor(upper, device=values.device)
        a, b = x.index_select(-1, lo), x.index_select(-1, hi)
        alpha = cauchy_weight(b - a, steepness)
        x = x.index_copy(-1, lo, alpha * a + (1 - alpha) * b).index_copy(
            -1, hi, (1 - alpha) * a + alpha * b)
        pa, pb = perm.index_select(-1, lo), perm.index_select(-1, hi)
        w = alpha.unsqueeze(-2)
        perm = perm.index_copy(-1, lo, w * pa + (1 - w) * pb).index_copy(
            -1, hi, (1 - w) * pa + w * pb)
    return x, perm
