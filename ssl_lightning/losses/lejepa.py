"""LeJEPA loss: SIGReg on every view plus invariance to the centre of the global views.

Balestriero & LeCun, "LeJEPA: Provable and Scalable Self-Supervised Learning Without the
Heuristics", arXiv 2511.08544 (2025), §5 and the paper's minimal implementation:

``ℓ = λ · 1/V Σ_v SIGReg(Z_v) + (1 − λ) · 1/(V·B·D) Σ_v Σ_b ||c_b − z_{b,v}||²``

with ``c_b = 1/G Σ_{g<G} z_{b,g}`` the mean of sample b's G global views, V all views (global
and local) and λ = 0.05. SIGReg is a statistic of the global batch (its sums go through the
injected ``reduce_sum``); the invariance term is a per-sample mean over this rank's samples, so
the mean of the rank losses is the single-process loss.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.sigreg import ReduceSum, SIGRegLoss


class LeJEPALoss(nn.Module):
    """λ·SIGReg(all views) + (1 − λ)·invariance to the mean of the global views.

    Args:
        lambda_sigreg: λ in [0, 1] (0.05 in the paper's code and lightly).
        num_global_views: G, the leading views whose mean is the invariance target (2).
        num_slices: SIGReg directions per step (see :class:`SIGRegLoss`).
        knots: SIGReg trapezoid points on [0, t_max].
        t_max: SIGReg integration range.
    """

    def __init__(self, lambda_sigreg: float = 0.05, num_global_views: int = 2,
                 num_slices: int = 1024, knots: int = 17, t_max: float = 3.0) -> None:
        super().__init__()
        if not 0 <= lambda_sigreg <= 1:
            raise ValueError(f"LeJEPALoss lambda_sigreg must be in [0, 1], got {lambda_sigreg}.")
        if num_global_views < 1:
            raise ValueError(
                f"LeJEPALoss num_global_views must be >= 1, got {num_global_views}.")
        self.lambda_sigreg = lambda_sigreg
        self.num_global_views = num_global_views
        self.sigreg = SIGRegLoss(num_slices, knots, t_max)

    def terms(self, z: Tensor, directions: Tensor, reduce_sum: ReduceSum | None = None
              ) -> tuple[Tensor, Tensor]:
        """``(sigreg, invariance)`` of this rank, in fp32 (or fp64).

        Args:
            z: Local embeddings (B, V, D), the G global views first.
            directions: (D, M) SIGReg directions, identical on every rank.
            reduce_sum: Differentiable sum over ranks (identity when omitted).
        """
        if z.dim() != 3 or z.shape[1] < self.num_global_views:
            raise ValueError(f"LeJEPALoss expects (B, V, D) embeddings with V >= "
                             f"{self.num_global_views} views, got {tuple(z.shape)}.")
        with torch.autocast(device_type=z.device.type, enabled=False):
            z = at_least_fp32(z)
            centre = z[:, :self.num_global_views].mean(dim=1, keepdim=True)
            invariance = (centre - z).square().mean()
            return self.sigreg(z, directions, reduce_sum), invariance

    def forward(self, z: Tensor, directions: Tensor, reduce_sum: ReduceSum | None = None
                ) -> Tensor:
        """The loss of this rank (arguments as in :meth:`terms`)."""
        sigreg, invariance = self.terms(z, directions, reduce_sum)
        return self.lambda_sigreg * sigreg + (1 - self.lambda_sigreg) * invariance
