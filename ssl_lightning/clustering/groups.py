"""SMoG's momentum grouping: Pang et al., "Unsupervised Visual Representation Learning by
Synchronous Momentum Grouping", ECCV 2022, §3.2: every group feature moves towards the mean of
the samples assigned to it, ``g_k ← β g_k + (1 − β) mean_{i: a_i = k} x_i`` (β = 0.99), groups
without samples staying where they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_lightning.clustering.kmeans import assign_to_centroids


@torch.no_grad()
def momentum_group_update(groups: Tensor, rows: Tensor, beta: float) -> Tensor:
    """The group features (G, D) after one momentum step towards their assigned ``rows``
    (N, D; the global batch, the same on every rank)."""
    assignment = assign_to_centroids(rows, groups)
    sums = torch.zeros_like(groups).index_add_(0, assignment, rows.to(groups.dtype))
    counts = torch.bincount(assignment, minlength=groups.shape[0]).to(groups.dtype)
    means = sums / counts.clamp(min=1).unsqueeze(1)
    moved = beta * groups + (1 - beta) * means
    return torch.where((counts > 0).unsqueeze(1), moved, groups)
