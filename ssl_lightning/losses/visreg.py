"""VISReg loss: LeJEPA's invariance plus decoupled scale, shape and centre regularisers.

Wu, Balestriero & Levine, "VISReg: Variance-Invariance-Sketching Regularization for JEPA
training", arXiv 2606.02572 (2026), §3 and Algorithm 1. For the embeddings Z_v (N × D) of each
view v over the global batch of N samples, with per-dimension mean μ and standard deviation σ
(biased) over the batch:

- scale (Eq. 1): ``1/D Σ_j (1 − σ_j)²``;
- shape (Eqs. 2, 5): ``Ẑ = (Z − μ) / (sg(σ) + ε)`` (stop-gradient on σ, so shape does not fight
  scale), projected on M random unit directions a_m; the sorted projections are compared with
  the N(0, 1) quantiles ``q_i = Φ⁻¹(i / (N + 1))``, i = 1 … N:
  ``1/(N·M) Σ_m Σ_i (sort(Ẑ a_m)_i − q_i)²``, the closed-form 1-D 2-Wasserstein distance;
- centre (Eq. 6): ``1/D Σ_j μ_j²``;

each averaged over the views, and the invariance (Eq. 8, LeJEPA's) pulls every view to the mean
of the G global views of its sample: ``1/(V·B·D) Σ ||c_b − z_{b,v}||²``. The loss is
``(1 − λ)·invariance + λ·(λ_scale·scale + λ_shape·shape + λ_center·center)``.

The regularisers are statistics of the global batch: the method passes the embeddings gathered
from all ranks with gradients, and the directions of the step, the same on every rank, so N
processes give the loss of one process on the global batch (lightly's class computes them per
device with per-device random directions; docs/methods.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32

#: The names of the terms :meth:`VISRegLoss.terms` returns, in order.
TERMS = ("invariance", "scale", "shape", "center")


def gaussian_quantiles(n: int, like: Tensor) -> Tensor:
    """``Φ⁻¹(i / (n + 1))`` for i = 1 … n, computed in float64, as (n, 1) in ``like``'s dtype."""
    positions = torch.arange(1, n + 1, dtype=torch.float64) / (n + 1)
    return torch.special.ndtri(positions).to(device=like.device, dtype=like.dtype).unsqueeze(-1)


class VISRegLoss(nn.Module):
    """(1 − λ)·invariance + λ·(λ_scale·scale + λ_shape·shape + λ_center·center).

    Args:
        lambda_param: λ in [0, 1] (0.9 for ImageNet-scale data; the paper recommends 0.6 for
            small datasets).
        num_global_views: G, the leading views whose mean is the invariance target (2).
        lambda_scale: Weight of the scale term (1).
        lambda_shape: Weight of the shape term (1; larger for long-tailed or low-rank data).
        lambda_center: Weight of the centre term (1).
        eps: Added to σ before the shape normalisation (1e-4).
    """

    def __init__(self, lambda_param: float = 0.9, num_global_views: int = 2,
                 lambda_scale: float = 1.0, lambda_shape: float = 1.0,
                 lambda_center: float = 1.0, eps: float = 1e-4) -> None:
        super().__init__()
        if not 0 <= lambda_param <= 1:
            raise ValueError(f"VISRegLoss lambda_param must be in [0, 1], got {lambda_param}.")
        if num_global_views < 1:
            raise ValueError(f"VISRegLoss num_global_views must be >= 1, got "
                             f"{num_global_views}.")
        weights = {"lambda_scale": lambda_scale, "lambda_shape": lambda_shape,
                   "lambda_center": lambda_center}
        for name, value in weights.items():
            if value < 0:
                raise ValueError(f"VISRegLoss {name} must be >= 0, got {value}.")
        if not eps > 0:
            raise ValueError(f"VISRegLoss eps must be > 0, got {eps}.")
        self.lambda_param, self.num_global_views = lambda_param, num_global_views
        self.lambda_scale, self.lambda_shape = lambda_scale, lambda_shape
        self.lambda_center, self.eps = lambda_center, eps

    def terms(self, z: Tensor, z_all: Tensor, directions: Tensor
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The unweighted terms :data:`TERMS` ``(invariance, scale, shape, center)``, in fp32
        (or fp64).

        Args:
            z: This rank's embeddings (B, V, D), the G global views first.
            z_all: The embeddings of the global batch (N, V, D), gathered with gradients
                (``z`` on one process).
            directions: (D, M) unit directions of the shape term, the same on every rank.
        """
        if z.dim() != 3 or z.shape[1] < self.num_global_views:
            raise ValueError(f"VISRegLoss expects (B, V, D) embeddings with V >= "
                             f"{self.num_global_views} views, got {tuple(z.shape)}.")
        if z_all.shape[1:] != z.shape[1:] or z_all.shape[0] < 2:
            raise ValueError(f"VISRegLoss needs the global batch (N >= 2, V, D) matching the "
                             f"local {tuple(z.shape)}, got {tuple(z_all.shape)}.")
        if directions.shape[0] != z.shape[-1]:
            raise ValueError(f"VISRegLoss directions must be (D={z.shape[-1]}, M), got "
                             f"{tuple(directions.shape)}.")
        with torch.autocast(device_type=z.device.type, enabled=False):
            z, z_all = at_least_fp32(z), at_least_fp32(z_all)
            centre = z[:, :self.num_global_views].mean(dim=1, keepdim=True)
            invariance = (centre - z).square().mean()
            views = z_all.transpose(0, 1)  # (V, N, D): each view's batch is one sample set
            mean = views.mean(dim=1, keepdim=True)
            std = views.std(dim=1, correction=0, keepdim=True)
            scale = (1 - std).square().mean()
            center = mean.square().mean()
            normalised = (views - mean) / (std.detach() + self.eps)
            projections = normalised @ directions.to(normalised.dtype)
            quantiles = gaussian_quantiles(views.shape[1], projections)
            shape = (projections.sort(dim=1).values - quantiles).square().mean()
        return invariance, scale, shape, center

    def combine(self, invariance: Tensor, scale: Tensor, shape: Tensor, center: Tensor
                ) -> Tensor:
        """The weighted loss from the output of :meth:`terms`."""
        regulariser = (self.lambda_scale * scale + self.lambda_shape * shape
                       + self.lambda_center * center)
        return (1 - self.lambda_param) * invariance + self.lambda_param * regulariser

    def forward(self, z: Tensor, z_all: Tensor, directions: Tensor) -> Tensor:
        """The loss of this rank (arguments as in :meth:`terms`)."""
        return self.combine(*self.terms(z, z_all, directions))
