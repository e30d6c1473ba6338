"""TiCo loss: transformation invariance and covariance contrast.

Zhu, Moraes, Karakulak, Sobol, Canziani & LeCun, "TiCo: Transformation Invariance and Covariance
Contrast for Self-Supervised Visual Representation Learning", arXiv 2206.10698 (2022), Eq. (5)
and Algorithm 1: with L2-normalised embeddings z_a (online network, view a) and z_b (momentum
network, view b),

``C_t = β C_{t−1} + (1 − β) · 1/N Σ_n z_a,n z_a,nᵀ``  (no gradient, C_0 = 0),
``ℓ = 1 − 1/B Σ_n ⟨z_a,n, z_b,n⟩ + ρ · 1/B Σ_n z_a,nᵀ C_t z_a,n``

with β = 0.9 and ρ = 8. C is a running covariance of the online embeddings: a persistent buffer
(in the checkpoint, so a resumed run continues with it), updated after the loss from the
*gathered* batch (N samples over all ranks), so every rank holds the same C. Both terms are
per-sample means over this rank's B samples, so the mean of the rank losses is the
single-process loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


class TiCoLoss(nn.Module):
    """TiCo loss with its running covariance ``covariance`` (a persistent fp32 buffer).

    Args:
        dim: Embedding size D (C is D × D).
        beta: β, momentum of the running covariance (0.9).
        rho: ρ, weight of the covariance-contrast term (8).
    """

    def __init__(self, dim: int, beta: float = 0.9, rho: float = 8.0) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"TiCoLoss dim must be >= 1, got {dim}.")
        if not 0 <= beta < 1:
            raise ValueError(f"TiCoLoss beta must be in [0, 1), got {beta}.")
        if rho < 0:
            raise ValueError(f"TiCoLoss rho must be >= 0, got {rho}.")
        self.beta = beta
        self.rho = rho
        self.register_buffer("covariance", torch.zeros(dim, dim))

    def forward(self, z_a: Tensor, z_b: Tensor, z_a_all: Tensor | None = None) -> Tensor:
        """The loss of this rank; updates :attr:`covariance` from the global batch.

        Args:
            z_a: Online embeddings of view a, (B, D).
            z_b: Momentum-network embeddings of view b, (B, D); no gradient flows into them.
            z_a_all: ``z_a`` gathered from all ranks (any gradient is ignored), (N, D);
                ``z_a`` when omitted (one process).
        """
        if z_a.dim() != 2 or z_a.shape != z_b.shape or z_a.shape[1] != self.covariance.shape[0]:
            raise ValueError(f"TiCoLoss expects two (B, {self.covariance.shape[0]}) tensors, got "
                             f"{tuple(z_a.shape)} and {tuple(z_b.shape)}.")
        z_a_all = z_a if z_a_all is None else z_a_all
        with torch.autocast(device_type=z_a.device.type, enabled=False):
            z_a = F.normalize(at_least_fp32(z_a), dim=1)
            z_b = F.normalize(at_least_fp32(z_b.detach()), dim=1)
            with torch.no_grad():
                z_all = F.normalize(at_least_fp32(z_a_all.detach()), dim=1)
                batch_cov = z_all.T @ z_all / z_all.shape[0]
                cov = self.beta * self.covariance.to(batch_cov.dtype) + (1 - self.beta) * batch_cov
            invariance = 1 - (z_a * z_b).sum(dim=1).mean()
            contrast = ((z_a @ cov) * z_a).sum(dim=1).mean()
            loss = invariance + self.rho * contrast
        if self.training:
            self.covariance.copy_(cov)
        return loss
