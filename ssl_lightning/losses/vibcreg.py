"""VIbCReg loss: VICReg's invariance and variance terms with a feature-decorrelation term.

Lee & Aune, "VIbCReg: Variance-Invariance-better-Covariance Regularization for Self-Supervised
Learning on Time Series", arXiv 2109.00783 (2021), §3: the covariance term of VICReg is
replaced by one on the *correlation-like* matrix of the centred, per-feature L2-normalised
embeddings,

``ẑ^j = (z^j − z̄^j) / ||z^j − z̄^j||₂`` (over the batch),  ``C = ẐᵀẐ``,
``c(Z) = 1/D² Σ_{i≠j} C_ij²``,

which lies in [0, 1] whatever the feature scale, and the variance hinge is summed over the two
views, ``v(Z) + v(Z′)`` (VICReg's Algorithm 1 halves it; the weights λ = μ = 25, ν = 200 of
solo-learn's recipe are tuned for its sum). Statistics of the global batch, as in
:class:`~ssl_lightning.losses.VICRegLoss`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.losses.numerics import off_diagonal
from ssl_lightning.losses.vicreg import VICRegLoss


class VIbCRegLoss(VICRegLoss):
    """VIbCReg loss over two views (arguments as :class:`VICRegLoss`; ν = 200 by default)."""

    def __init__(self, invariance_weight: float = 25.0, variance_weight: float = 25.0,
                 covariance_weight: float = 200.0, eps: float = 1e-4) -> None:
        super().__init__(invariance_weight, variance_weight, covariance_weight, eps)

    def terms(
        self, z1: Tensor, z2: Tensor, z1_all: Tensor | None = None, z2_all: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The unweighted ``(invariance, v(Z) + v(Z′), c(Z) + c(Z′))``, in fp32 (or fp64)."""
        invariance, halved_variance, covariance = super().terms(z1, z2, z1_all, z2_all)
        return invariance, 2 * halved_variance, covariance

    @staticmethod
    def _covariance(z: Tensor) -> Tensor:
        normalised = F.normalize(z - z.mean(dim=0), dim=0)
        correlation = normalised.T @ normalised
        return off_diagonal(correlation).pow(2).sum() / z.shape[1] ** 2
