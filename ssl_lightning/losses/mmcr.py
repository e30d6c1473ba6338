"""MMCR loss: maximum manifold capacity representations.

Yerxa, Kuang, Simoncelli & Chung, "Learning Efficient Coding of Natural Images with Maximum
Manifold Capacity Representations", NeurIPS 2023, Eq. (4): the k views of sample b, normalised
to the unit sphere, are the rows of Z_b (k × D); their centroids are the rows of C (N × D), and

``ℓ = −||C||_* + λ/N Σ_b ||Z_b||_*``

with ``||·||_*`` the nuclear norm (sum of singular values). Maximising the nuclear norm of the
centroid matrix spreads the sample manifolds apart; the optional λ term shrinks each manifold.

Under DDP ||C||_* is a statistic of the *global* batch: the method passes the centroids gathered
from all ranks with gradients (``c_all``), every rank computes the same value, and the backward
of the gathering sums its gradient over the ranks, which DDP's averaging divides again. The
λ term is a per-sample mean over this rank's samples. Singular values are computed in fp32 (or
fp64) with autocast off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


def centroids(z: Tensor) -> Tensor:
    """The per-sample centroids (B, D) of the unit-normalised views z (B, k, D), in fp32+."""
    return F.normalize(at_least_fp32(z), dim=-1).mean(dim=1)


class MMCRLoss(nn.Module):
    """−(nuclear norm of the centroid matrix) + λ · mean nuclear norm of the view matrices.

    Args:
        lambda_views: λ, weight of the per-sample view-matrix term (lightly's 5e-3; 0 removes
            it).
    """

    def __init__(self, lambda_views: float = 5e-3) -> None:
        super().__init__()
        if lambda_views < 0:
            raise ValueError(f"MMCRLoss lambda_views must be >= 0, got {lambda_views}.")
        self.lambda_views = lambda_views

    def forward(self, z: Tensor, c_all: Tensor | None = None) -> Tensor:
        """The loss of this rank.

        Args:
            z: Local embeddings (B, k, D) of k >= 2 views (any scale; normalised here).
            c_all: ``centroids(z)`` gathered from all ranks with gradients, (N, D);
                ``centroids(z)`` when omitted (one process).
        """
        if z.dim() != 3 or z.shape[1] < 2:
            raise ValueError(f"MMCRLoss expects (B, k, D) embeddings with k >= 2 views, got "
                             f"{tuple(z.shape)}.")
        with torch.autocast(device_type=z.device.type, enabled=False):
            c_all = centroids(z) if c_all is None else at_least_fp32(c_all)
            loss = -torch.linalg.svdvals(c_all).sum()
            if self.lambda_views:
                views = F.normalize(at_least_fp32(z), dim=-1)
                loss = loss + self.lambda_views * torch.linalg.svdvals(views).sum(dim=1).mean()
            return loss
