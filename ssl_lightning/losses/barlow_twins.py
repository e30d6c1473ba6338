"""Barlow Twins loss: make the cross-correlation of two views' embeddings the identity.

Zbontar, Jing, Misra, LeCun & Deny, "Barlow Twins: Self-Supervised Learning via Redundancy
Reduction", ICML 2021, Eqs. (1)-(2) and Algorithm 1: each embedding dimension is normalised
over the batch (mean 0, std 1: an affine-free BatchNorm, biased variance, ε = 1e-5), then

``C_ij = Σ_b ẑ1_bi ẑ2_bj / N``  and  ``L = Σ_i (1 − C_ii)² + λ Σ_i Σ_{j≠i} C_ij²``

with λ = 5.1e-3 in the paper (λ = 1/D is a common dimension-independent alternative).

Under DDP the mean, the variance and C are sums over the *global* batch. This loss computes
them from per-rank partial sums through an injected ``reduce_sum`` (the method passes
:func:`ssl_lightning.distributed.all_reduce_sum_with_grad`), so every rank gets the same global
loss. That collective must be autograd-aware: its backward sums the gradient over ranks, which
DDP's averaging divides by W again. A plain ``dist.all_reduce`` (as in the official code, which
also relies on SyncBatchNorm for the normalisation) keeps only the local contribution in the
backward pass and scales every gradient by 1/W. Summing statistics instead of gathering
embeddings also accepts unequal per-rank batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32, off_diagonal

ReduceSum = Callable[[Tensor], Tensor]


def _identity(x: Tensor) -> Tensor:
    return x


class BarlowTwinsLoss(nn.Module):
    """Barlow Twins redundancy-reduction loss over the global batch.

    Args:
        lambda_offdiag: λ, weight of the off-diagonal term; ``None`` uses 1/D.
        eps: Added to the per-dimension variance before the square root (BatchNorm's 1e-5).
    """

    def __init__(self, lambda_offdiag: float | None = 0.0051, eps: float = 1e-5) -> None:
        super().__init__()
        if lambda_offdiag is not None and lambda_offdiag < 0:
            raise ValueError(f"BarlowTwinsLoss lambda_offdiag must be >= 0, got {lambda_offdiag}.")
        if eps < 0:
            raise ValueError(f"BarlowTwinsLoss eps must be >= 0, got {eps}.")
        self.lambda_offdiag = lambda_offdiag
        self.eps = eps

    def cross_correlation(
        self, z1: Tensor, z2: Tensor, reduce_sum: ReduceSum | None = None
    ) -> Tensor:
        """The (D, D) cross-correlation matrix C of the batch-normalised embeddings, in fp32.

        Args:
            z1: Local embeddings of view 1, shape (B, D).
            z2: Local embeddings of view 2, shape (B, D); row i pairs with ``z1[i]``.
            reduce_sum: Sums a tensor over all ranks, differentiably (identity when omitted).
        """
        if z1.shape != z2.shape or z1.dim() != 2:
            raise ValueError(
                f"BarlowTwinsLoss expects two (B, D) tensors of equal shape, got "
                f"{tuple(z1.shape)} and {tuple(z2.shape)}."
            )
        if reduce_sum is None and z1.shape[0] < 2:
            raise ValueError(f"BarlowTwinsLoss needs a batch of >= 2 samples, got {z1.shape[0]}.")
        reduce_sum = reduce_sum or _identity
        dim = z1.shape[1]
        with torch.autocast(device_type=z1.device.type, enabled=False):
            z = at_least_fp32(torch.stack([z1, z2]))  # (2, B, D)
            count = z.new_full((1,), z.shape[1])
            sums = reduce_sum(torch.cat([z.sum(dim=1).flatten(), count]))
            n = sums[-1]
            centered = z - (sums[:-1] / n).view(2, 1, dim)
            var = reduce_sum(centered.pow(2).sum(dim=1)) / n
            normed = centered / torch.sqrt(var + self.eps).unsqueeze(1)
            return reduce_sum(normed[0].T @ normed[1]) / n

    def forward(self, z1: Tensor, z2: Tensor, reduce_sum: ReduceSum | None = None) -> Tensor:
        """The loss (the same global value on every rank); arguments as in
        :meth:`cross_correlation`."""
        c = self.cross_correlation(z1, z2, reduce_sum)
        weight = 1.0 / c.shape[0] if self.lambda_offdiag is None else self.lambda_offdiag
        return (1 - torch.diagonal(c)).pow(2).sum() + weight * off_diagonal(c).pow(2).sum()
