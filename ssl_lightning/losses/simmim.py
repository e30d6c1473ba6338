"""The SimMIM reconstruction loss: mean absolute error on the masked patches' pixels.

Xie et al., "SimMIM: A Simple Framework for Masked Image Modeling", CVPR 2022, §3.1 (eq. 1):
``L = 1/Ω(x_M) · ‖y_M − x_M‖₁``, the ℓ1 distance between the predicted and the raw (input-
normalised) pixels of the masked patches, divided by their number of pixel values. The visible
patches carry no loss (the paper ablates this: predicting only the masked area is better).

Every sample has the same number of masked patches, so the mean over this rank's patches is the
mean of per-sample terms: under DDP no gathering is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_lightning.losses.mae import PixelReconstructionLoss
from ssl_lightning.losses.numerics import at_least_fp32


class SimMIMLoss(PixelReconstructionLoss):
    """``mean over masked patches and pixel values of |prediction − target|`` (raw pixels)."""

    def __init__(self) -> None:
        super().__init__(norm_pix_loss=False)

    def forward(self, predictions: Tensor, patches: Tensor) -> Tensor:
        """Loss of the local batch.

        Args:
            predictions: Predicted pixels of the masked patches (B, M, P), P = patch² · C.
            patches: The input pixels of the same patches (B, M, P), same pixel order.

        Returns:
            Scalar loss, in fp32 even under autocast.
        """
        self.check_same_shape(predictions, patches)
        with torch.autocast(predictions.device.type, enabled=False):
            pred, target = at_least_fp32(predictions), self.pixel_targets(patches)
            return (pred - target).abs().mean()
