"""The AIM loss: next-patch regression of normalised pixels, on the non-prefix patches.

El-Nouby et al., "Scalable Pre-training of Large Autoregressive Image Models", ICML 2024, §3:
the K patches of an image are predicted in raster order, patch k from patches < k; with a prefix
of S patches attended bidirectionally, the loss covers only the patches after it,
``L = 1/(K − S) · Σ_{k=S+1..K} ‖x̂_k − x_k‖²`` (S ~ U{1, ..., K − 1} per image), with per-patch
normalised pixel targets (as MAE's ``norm_pix_loss``; better than raw pixels in the paper's
  target ablation). Here
``‖·‖²`` is averaged over the P pixel values of a patch (a constant factor 1/P), and the batch's
loss is the mean of the images' terms, so under DDP no gathering is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_lightning.losses.mae import PixelReconstructionLoss
from ssl_lightning.losses.numerics import at_least_fp32


class AIMLoss(PixelReconstructionLoss):
    """Mean over images of the mean squared error of their non-prefix next-patch predictions.

    Args:
        norm_pix_loss: Standardise each target patch by its own mean and variance.
        eps: Added to the variance before the square root.
    """

    def forward(self, predictions: Tensor, patches: Tensor, prefix: Tensor) -> Tensor:
        """Loss of the local batch.

        Args:
            predictions: (B, K − 1, P): row k is the prediction of patch k + 1 (0-based), made
                at patch position k.
            patches: The image's pixels (B, K, P), row-major patches.
            prefix: (B,) prefix lengths S in [1, K − 1]: patches S..K−1 (0-based) carry the loss.

        Returns:
            Scalar loss, in fp32 even under autocast.
        """
        b, k, p = patches.shape
        if predictions.shape != (b, k - 1, p):
            raise ValueError(f"predictions must be (B, K - 1, P) = {(b, k - 1, p)} for patches "
                             f"{tuple(patches.shape)}, got {tuple(predictions.shape)}.")
        if prefix.shape != (b,) or (b and not 1 <= int(prefix.min()) <= int(prefix.max()) < k):
            raise ValueError(f"prefix must hold B = {b} lengths in [1, {k - 1}], got "
                             f"{prefix.tolist()}.")
        with torch.autocast(predictions.device.type, enabled=False):
            pred, target = at_least_fp32(predictions), self.pixel_targets(patches[:, 1:])
            errors = (pred - target).pow(2).mean(dim=-1)  # (B, K − 1): target patch k + 1
            target_index = torch.arange(1, k, device=errors.device)
            weights = (target_index.view(1, -1) >= prefix.view(-1, 1)).to(errors.dtype)
            return ((errors * weights).sum(dim=1) / weights.sum(dim=1)).mean()
