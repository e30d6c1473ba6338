"""W-MSE loss: whitening of sub-batches, then the normalised MSE between views.

Ermolov, Siarohin, Sangineto & Sebe, "Whitening for Self-Supervised Representation Learning",
ICML 2021, Eqs. (3)-(6) and Algorithm 1: the batch of N samples is split at random into
sub-batches of w samples (w > D); within each sub-batch every view's embeddings v are whitened,
``z = L⁻¹ (v − μ)`` with ``Σ = L Lᵀ`` the Cholesky factor of the sub-batch covariance
(unbiased; optionally shrunk to ``(1 − ε) Σ + ε I``), and the loss is

``ℓ = 2 − 2 · mean cos(z_i, z_j)``

over the pairs of views (i < j) and the samples, averaged over ``whitening_iters`` random splits.

Under DDP the sub-batches are drawn from the *gathered* batch (embeddings gathered with
gradients) with the same permutation on every rank, so every rank whitens exactly the
sub-batches one process would; the cosine term is then averaged over this rank's own samples
(``start``, ``count``), so the mean of the rank losses is the single-process loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


class WhiteningError(RuntimeError):
    """A sub-batch covariance has no Cholesky factor (not positive definite)."""


def whiten(x: Tensor, eps: float = 0.0) -> Tensor:
    """Cholesky whitening of each (w, D) group of ``x`` (..., w, D): ``L⁻¹ (x − μ)``.

    Raises:
        WhiteningError: a covariance is not positive definite (collapsed, rank-deficient
            embeddings, or non-finite ones), naming ``whitening_eps`` and a value to try.
    """
    centred = x - x.mean(dim=-2, keepdim=True)
    cov = centred.transpose(-1, -2) @ centred / (x.shape[-2] - 1)
    if eps:
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        cov = (1 - eps) * cov + eps * eye
    try:
        factor = torch.linalg.cholesky(cov)
    except torch.linalg.LinAlgError as err:
        raise WhiteningError(
            f"W-MSE cannot whiten a sub-batch of {x.shape[-2]} embeddings of size "
            f"{x.shape[-1]}: their covariance is not positive definite (the embeddings have "
            f"collapsed onto fewer directions, or are not finite) and whitening_eps is {eps:g}. "
            "Shrink the covariance towards the identity with whitening_eps > 0, e.g. "
            "--model.whitening_eps 1e-4 (and check the learning rate).") from err
    return torch.linalg.solve_triangular(factor, centred.transpose(-1, -2),
                                         upper=False).transpose(-1, -2)


class WMSELoss(nn.Module):
    """Whitened normalised MSE between every pair of views.

    Args:
        whitening_size: w, samples per whitening sub-batch (must exceed the embedding size D and
            divide the global batch; 128 for CIFAR in solo-learn and the paper).
        eps: ε, shrinkage of the covariance towards the identity (0).
    """

    def __init__(self, whitening_size: int = 128, eps: float = 0.0) -> None:
        super().__init__()
        if whitening_size < 2:
            raise ValueError(f"WMSELoss whitening_size must be >= 2, got {whitening_size}.")
        if not 0 <= eps < 1:
            raise ValueError(f"WMSELoss eps must be in [0, 1), got {eps}.")
        self.whitening_size = whitening_size
        self.eps = eps

    def forward(self, v_all: Tensor, permutations: Sequence[Tensor], start: int = 0,
                count: int | None = None) -> Tensor:
        """The loss of this rank.

        Args:
            v_all: Embeddings of the global batch (N, V, D), V >= 2 views, gathered with
                gradients (the local batch on one process).
            permutations: One permutation of ``range(N)`` per whitening iteration, identical on
                every rank; consecutive runs of w entries form the sub-batches.
            start: Index of this rank's first sample in ``v_all``.
            count: This rank's samples (all N when omitted).
        """
        n, views, dim = v_all.shape
        count = n - start if count is None else count
        w = self.whitening_size
        if views < 2 or n % w or w <= dim:
            raise ValueError(
                f"WMSELoss needs (N, V >= 2, D) embeddings with whitening_size {w} > D and "
                f"dividing N, got {tuple(v_all.shape)}: choose a whitening_size > {dim} that "
                f"divides the global batch {n}.")
        with torch.autocast(device_type=v_all.device.type, enabled=False):
            v_all = at_least_fp32(v_all)
            total = v_all.new_zeros(())
            for permutation in permutations:
                order = permutation.to(v_all.device)
                groups = v_all[order].view(n // w, w, views, dim).transpose(1, 2)  # (G, V, w, D)
                whitened = whiten(groups, self.eps).transpose(1, 2).reshape(n, views, dim)
                mine = torch.argsort(order)[start:start + count]  # rows of this rank's samples
                z = F.normalize(whitened[mine], dim=-1)
                pairs = [(i, j) for i in range(views) for j in range(i + 1, views)]
                total = total + sum(
                    2 - 2 * (z[:, i] * z[:, j]).sum(dim=-1).mean() for i, j in pairs
                ) / len(pairs)
            return total / len(permutations)
