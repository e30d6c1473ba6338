"""VICReg loss: variance-invariance-covariance regularisation.

Bardes, Ponce & LeCun, "VICReg: Variance-Invariance-Covariance Regularization for
Self-Supervised Learning", ICLR 2022, Eqs. (1)-(6) and Algorithm 1:

- invariance ``s(Z, Z') = 1/(N·D) Σ_i ||z_i − z'_i||²`` (mean squared error);
- variance ``v(Z) = 1/D Σ_j max(0, γ − sqrt(Var(z^j) + ε))`` with γ = 1, ε = 1e-4 and the
  unbiased variance over the batch;
- covariance ``c(Z) = 1/D Σ_{i≠j} C(Z)_ij²`` with ``C(Z) = 1/(N−1) Σ_k (z_k − z̄)(z_k − z̄)ᵀ``;
- ``ℓ = λ·s(Z, Z') + μ·[v(Z) + v(Z')]/2 + ν·[c(Z) + c(Z')]`` (the halved variance sum is the
  one of the paper's Algorithm 1 and official code, for which λ = μ = 25, ν = 1 were tuned).

Under DDP, variance and covariance are statistics of the *global* batch: the method passes the
embeddings gathered from all ranks (with gradients) and every rank computes the same global
terms; the invariance term is a per-sample mean over the *local* pairs. The mean over ranks of
the rank losses is then the single-process loss, and the gradients match too: the backward of
the gradient-carrying gather sums each global term's gradient over the W ranks, which DDP's
averaging divides by W again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.chunked_contrastive import check_two_views
from ssl_lightning.losses.numerics import at_least_fp32, off_diagonal


class VICRegLoss(nn.Module):
    """VICReg loss over two views, with variance/covariance over the gathered global batch.

    Args:
        invariance_weight: λ, weight of the mean-squared-error term (25 in the paper).
        variance_weight: μ, weight of the std hinge term (25 in the paper).
        covariance_weight: ν, weight of the off-diagonal covariance term (1 in the paper).
        eps: ε added to the variance inside the square root (1e-4 in the paper).
    """

    def __init__(
        self,
        invariance_weight: float = 25.0,
        variance_weight: float = 25.0,
        covariance_weight: float = 1.0,
        eps: float = 1e-4,
    ) -> None:
        super().__init__()
        for name, value in [("invariance_weight", invariance_weight),
                            ("variance_weight", variance_weight),
                            ("covariance_weight", covariance_weight)]:
            if value < 0:
                raise ValueError(f"VICRegLoss {name} must be >= 0, got {value}.")
        if not eps > 0:
            raise ValueError(f"VICRegLoss eps must be > 0, got {eps}.")
        self.invariance_weight = invariance_weight
        self.variance_weight = variance_weight
        self.covariance_weight = covariance_weight
        self.eps = eps

    def terms(
        self, z1: Tensor, z2: Tensor, z1_all: Tensor | None = None, z2_all: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The unweighted ``(invariance, variance, covariance)`` terms, in fp32 (or fp64).

        Args:
            z1: Local embeddings of view 1, shape (B, D).
            z2: Local embeddings of view 2, shape (B, D); row i pairs with ``z1[i]``.
            z1_all: View-1 embeddings gathered from all ranks with gradients, (N, D); ``z1``
                when omitted (one process).
            z2_all: View-2 embeddings gathered from all ranks, (N, D); ``z2`` when omitted.
        """
        z1_all, z2_all, _ = check_two_views("VICRegLoss", z1, z2, z1_all, z2_all, rank_offset=0)
        if z1_all.shape != z2_all.shape or z1_all.shape[1:] != z1.shape[1:]:
            raise ValueError(
                f"Gathered embeddings {tuple(z1_all.shape)} and {tuple(z2_all.shape)} do not "
                f"match the local ones {tuple(z1.shape)}."
            )
        if z1_all.shape[0] < 2:
            raise ValueError(
                f"VICRegLoss needs a global batch of at least 2 samples, got {z1_all.shape[0]}."
            )
        with torch.autocast(device_type=z1.device.type, enabled=False):
            z1, z2, z1_all, z2_all = (at_least_fp32(z) for z in (z1, z2, z1_all, z2_all))
            invariance = F.mse_loss(z1, z2)
            variance = (self._variance(z1_all) + self._variance(z2_all)) / 2
            covariance = self._covariance(z1_all) + self._covariance(z2_all)
        return invariance, variance, covariance

    def forward(
        self, z1: Tensor, z2: Tensor, z1_all: Tensor | None = None, z2_all: Tensor | None = None
    ) -> Tensor:
        """Weighted VICReg loss of this rank (arguments as in :meth:`terms`)."""
        return self.combine(*self.terms(z1, z2, z1_all, z2_all))

    def combine(self, invariance: Tensor, variance: Tensor, covariance: Tensor) -> Tensor:
        """``λ·invariance + μ·variance + ν·covariance`` from the output of :meth:`terms`."""
        return (self.invariance_weight * invariance + self.variance_weight * variance
                + self.covariance_weight * covariance)

    def _variance(self, z: Tensor) -> Tensor:
        return variance_term(z, self.eps)

    @staticmethod
    def _covariance(z: Tensor) -> Tensor:
        return covariance_term(z)


def variance_term(z: Tensor, eps: float = 1e-4) -> Tensor:
    """``v(Z)``: the mean hinge ``max(0, 1 − sqrt(Var(z^j) + ε))`` of the unbiased variances
    over dim 0 of ``z`` (B, ..., D) (for (B, K, D), one variance per slot k and feature j)."""
    return F.relu(1 - torch.sqrt(z.var(dim=0) + eps)).mean()


def covariance_term(z: Tensor) -> Tensor:
    """``c(Z)``: ``1/D Σ_{i≠j} C(Z)_ij²`` of the covariance over dim 0 of ``z`` (B, ..., D),
    averaged over the other dimensions (for (B, K, D), one covariance matrix per slot k)."""
    centered = z - z.mean(dim=0)
    if z.dim() == 2:
        cov = centered.T @ centered / (z.shape[0] - 1)
        return off_diagonal(cov).pow(2).sum() / z.shape[1]
    cov = torch.einsum("b...c,b...d->...cd", centered, centered) / (z.shape[0] - 1)
    diagonal = torch.diagonal(cov, dim1=-2, dim2=-1).pow(2).sum(-1)
    return ((cov.pow(2).sum((-2, -1)) - diagonal) / z.shape[-1]).mean()
