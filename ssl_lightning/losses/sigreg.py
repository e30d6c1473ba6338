"""SIGReg: sketched isotropic Gaussian regularisation (the regulariser of LeJEPA).

Balestriero & LeCun, "LeJEPA: Provable and Scalable Self-Supervised Learning Without the
Heuristics", arXiv 2511.08544 (2025), §4 and the paper's minimal implementation: the embeddings
are projected onto M random unit directions a_m, and each 1-D projection x = zᵀa_m is tested
against N(0, 1) with the Epps–Pulley statistic

``EP = N · ∫ |φ_N(t) − e^{−t²/2}|² e^{−t²/2} dt``,  ``φ_N(t) = 1/N Σ_n e^{i t x_n}``,

integrated by the trapezoid rule on [−t_max, t_max] (t_max = 3, 17 knots on [0, 3]; the
integrand is even, so the half grid with doubled weights is the full one). SIGReg is the mean of
EP over the M directions (and over the views when several are given).

Under DDP, N is the global batch and φ_N is a mean over it: the sums of ``cos(t x)`` and
``sin(t x)`` (and the sample count) are summed over ranks by an injected ``reduce_sum``, which
must be autograd-aware (:func:`ssl_lightning.distributed.all_reduce_sum_with_grad`); a plain
``dist.all_reduce`` keeps only the local share in the backward pass and scales the gradient by
1/world_size (lightly#1920). The directions must be the same on every rank: the method draws
them from the step's shared seed (:func:`sigreg_directions`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32

ReduceSum = Callable[[Tensor], Tensor]


def sigreg_directions(dim: int, num_slices: int, generator: torch.Generator,
                      device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """``num_slices`` random unit directions of R^dim as the columns of a (dim, M) matrix.

    Drawn in float64 on the CPU from ``generator`` and then moved, so the same seed gives the
    same directions on every device and in every precision.
    """
    directions = torch.randn(dim, num_slices, generator=generator, dtype=torch.float64)
    directions /= directions.norm(dim=0, keepdim=True)
    return directions.to(device=device, dtype=dtype)


class SIGRegLoss(nn.Module):
    """Epps–Pulley statistic of random 1-D projections against N(0, 1), averaged.

    Args:
        num_slices: Directions M drawn per step (1024 in lightly; the paper's code uses 256 -
            1024).
        knots: Points of the trapezoid grid on [0, t_max] (17).
        t_max: End of the integration range (3).
    """

    def __init__(self, num_slices: int = 1024, knots: int = 17, t_max: float = 3.0) -> None:
        super().__init__()
        if num_slices < 1:
            raise ValueError(f"SIGRegLoss num_slices must be >= 1, got {num_slices}.")
        if knots < 2:
            raise ValueError(f"SIGRegLoss knots must be >= 2, got {knots}.")
        if not t_max > 0:
            raise ValueError(f"SIGRegLoss t_max must be > 0, got {t_max}.")
        self.num_slices = num_slices
        t = torch.linspace(0, t_max, knots, dtype=torch.float64)
        weights = torch.full((knots,), 2 * t_max / (knots - 1), dtype=torch.float64)
        weights[[0, -1]] /= 2  # the doubled half-grid trapezoid = the full-grid one on [-t, t]
        gaussian = torch.exp(-t.square() / 2)
        self.register_buffer("t", t, persistent=False)
        self.register_buffer("gaussian", gaussian, persistent=False)
        self.register_buffer("weights", weights * gaussian, persistent=False)

    def forward(self, z: Tensor, directions: Tensor, reduce_sum: ReduceSum | None = None
                ) -> Tensor:
        """SIGReg of this rank's embeddings as part of the global batch (the same value on
        every rank).

        Args:
            z: Local embeddings (B, D), or (B, V, D) for V views tested separately and
                averaged.
            directions: (D, M) unit directions, identical on every rank.
            reduce_sum: Sums a tensor over ranks, differentiably (identity when omitted).
        """
        if z.dim() == 2:
            z = z.unsqueeze(1)
        if z.dim() != 3 or directions.dim() != 2 or directions.shape[0] != z.shape[-1]:
            raise ValueError(f"SIGRegLoss expects (B, [V,] D) embeddings and (D, M) directions, "
                             f"got {tuple(z.shape)} and {tuple(directions.shape)}.")
        with torch.autocast(device_type=z.device.type, enabled=False):
            z = at_least_fp32(z)
            t = self.t.to(z.dtype)
            x_t = (z @ directions.to(z.dtype)).unsqueeze(-1) * t  # (B, V, M, K)
            count = z.new_full((1,), z.shape[0])
            sums = torch.cat([x_t.cos().sum(0).flatten(), x_t.sin().sum(0).flatten(), count])
            if reduce_sum is not None:
                sums = reduce_sum(sums)
            n = sums[-1]
            cos_mean, sin_mean = (sums[:-1] / n).view(2, *x_t.shape[1:])
            error = (cos_mean - self.gaussian.to(z.dtype)).square() + sin_mean.square()
            return (error @ self.weights.to(z.dtype) * n).mean()
