"""Spherical k-means whose result does not depend on how the rows are split over processes.

Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster Assignments"
(NeurIPS 2020), Appendix (DeepCluster v2), and the official ``main_deepclusterv2.py``: the
embeddings of the whole dataset are clustered on the unit sphere; the assignment step takes the
centroid of largest cosine similarity, the update step sets every centroid to the L2-normalised
mean of its members. Pang et al., "Unsupervised Visual Representation Learning by Synchronous
Momentum Grouping" (ECCV 2022, SMoG) reset their group features with the same procedure.

Distributed: each rank passes its share of the rows; the per-cluster sums and counts of the
update step are summed over ranks (outside autograd), so every rank gets the centroids one
process gets on all rows. The initial centroids are rows of the whole bank chosen by a seeded
permutation (every rank holds or gathers the same bank), not a per-rank random draw.

Empty clusters keep their previous centroid (as the official DeepCluster v2 code does), so the
number of centroids stays ``k`` and the result stays a pure function of the rows and the seed.
scikit-learn's ``KMeans`` is not used: it cannot sum across ranks and picks its own starting
points, so it cannot be exact across process counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.distributed import all_reduce_sum_no_grad

#: Sums a tensor over ranks outside autograd (identity on one process).
Reduce = Callable[[Tensor], Tensor]


def initial_centroids(bank: Tensor, k: int, seed: int) -> Tensor:
    """``k`` distinct rows of ``bank`` (N, D), chosen by ``randperm(N)`` seeded by ``seed``.

    Raises:
        ValueError: ``k`` is not in [1, N].
    """
    if not 1 <= k <= bank.shape[0]:
        raise ValueError(
            f"k-means needs 1 <= k <= the number of rows, got k={k} for {bank.shape[0]} rows: "
            "lower the number of clusters / prototypes or use a larger dataset / bank.")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(bank.shape[0], generator=generator)[:k].to(bank.device)
    return bank[order].clone()


@torch.no_grad()
def assign_to_centroids(rows: Tensor, centroids: Tensor) -> Tensor:
    """Index (N,) of the centroid with the largest cosine similarity to each row (ties: the
    lowest index)."""
    return (F.normalize(rows, dim=1) @ F.normalize(centroids, dim=1).T).argmax(dim=1)


@torch.no_grad()
def update_centroids(rows: Tensor, assignments: Tensor, centroids: Tensor,
                     reduce: Reduce = all_reduce_sum_no_grad) -> Tensor:
    """L2-normalised mean of the rows assigned to each centroid, summed over ranks by
    ``reduce``; a centroid without rows (on any rank) keeps its previous value."""
    k = centroids.shape[0]
    sums = torch.zeros_like(centroids).index_add_(0, assignments, rows.to(centroids.dtype))
    counts = torch.bincount(assignments, minlength=k).to(centroids.dtype)
    sums, counts = reduce(sums), reduce(counts)
    means = F.normalize(sums / counts.clamp(min=1).unsqueeze(1), dim=1)
    return torch.where((counts > 0).unsqueeze(1), means, centroids)


@torch.no_grad()
def spherical_kmeans(rows: Tensor, initial: Tensor, iterations: int,
                     reduce: Reduce = all_reduce_sum_no_grad) -> Tensor:
    """Centroids (k, D) after ``iterations`` assignment + update rounds from ``initial``.

    Args:
        rows: This rank's share of the rows (N_rank, D); together the shares are the bank.
        initial: Starting centroids (k, D), the same on every rank
            (:func:`initial_centroids` of the whole bank).
        iterations: Rounds (DeepCluster v2: 10). 0 returns the normalised ``initial``.
        reduce: Sum over ranks; the default all-reduces, identity without a process group.
    """
    if iterations < 0:
        raise ValueError(f"k-means iterations must be >= 0, got {iterations}.")
    centroids = F.normalize(initial.to(rows.dtype), dim=1)
    for _ in range(iterations):
        centroids = update_centroids(rows, assign_to_centroids(rows, centroids), centroids,
                                     reduce)
    return centroids
