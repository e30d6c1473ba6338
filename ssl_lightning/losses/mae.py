"""The MAE reconstruction loss: mean squared error on the masked patches' (normalised) pixels.

He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022, §3: the mean squared
error between reconstructed and original pixels, computed on the masked patches only. With
``norm_pix_loss`` (the target of the paper's default setting, Table 1d) each target patch is
standardised by its own mean and standard deviation (the paper's code: unbiased variance,
``(x − mean) / sqrt(var + 1e-6)``).

Every sample has the same number of masked patches, so the mean over this rank's patches is the
mean of per-sample terms: under DDP no gathering is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


def patchify(images: Tensor, patch: int) -> Tensor:
    """(B, C, H, W) -> (B, H/p · W/p, p · p · C): row-major patches, pixels (row, col, channel)
    as in the paper's code."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def normalized_patches(patches: Tensor, eps: float = 1e-6) -> Tensor:
    """Each patch (last dim) standardised by its own mean and unbiased variance:
    ``(x − mean) / sqrt(var + eps)`` (MAE's ``norm_pix_loss`` target, also AIM's)."""
    mean, var = patches.mean(dim=-1, keepdim=True), patches.var(dim=-1, keepdim=True)
    return (patches - mean) / (var + eps).sqrt()


class PixelReconstructionLoss(nn.Module):
    """The pixel targets shared by MAE, SimMIM and AIM: the input patches, detached, in fp32
    even under autocast, each standardised by its own mean and variance with ``norm_pix_loss``.

    Args:
        norm_pix_loss: Standardise each target patch by its own mean and variance.
        eps: Added to the variance before the square root.
    """

    def __init__(self, norm_pix_loss: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}.")
        self.norm_pix_loss, self.eps = norm_pix_loss, eps

    def pixel_targets(self, patches: Tensor) -> Tensor:
        """The targets of ``patches`` (B, N, P): call with autocast off."""
        target = at_least_fp32(patches.detach())
        return normalized_patches(target, self.eps) if self.norm_pix_loss else target

    @staticmethod
    def check_same_shape(predictions: Tensor, patches: Tensor) -> None:
        """Refuse predictions that are not one per target pixel value."""
        if predictions.shape != patches.shape:
            raise ValueError(f"predictions {tuple(predictions.shape)} and patches "
                             f"{tuple(patches.shape)} must have the same shape.")


class MAELoss(PixelReconstructionLoss):
    """``mean over masked patches and pixels of (prediction − target)²``.

    Args:
        norm_pix_loss: Standardise each target patch by its own mean and variance.
        eps: Added to the variance before the square root.
    """

    def forward(self, predictions: Tensor, patches: Tensor) -> Tensor:
        """Loss of the local batch.

        Args:
            predictions: Decoder outputs of the masked patches (B, M, P), P = patch² · 3.
            patches: The original pixels of the same patches (B, M, P), same pixel order.

        Returns:
            Scalar loss, in fp32 even under autocast.
        """
        self.check_same_shape(predictions, patches)
        with torch.autocast(predictions.device.type, enabled=False):
            pred, target = at_least_fp32(predictions), self.pixel_targets(patches)
            return (pred - target).pow(2).mean()
