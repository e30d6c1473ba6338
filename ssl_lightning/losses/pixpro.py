"""The PixPro loss: Xie, Lin, Zhang, Cao, Lin & Hu, "Propagate Yourself: Exploring Pixel-Level
Consistency for Unsupervised Visual Representation Learning", CVPR 2021, §3.2, Eq. (4).

The pixel-to-propagation consistency: at every positive pair (i, j) of locations of views 1
and 2 (close in the original image, :func:`~ssl_lightning.losses.dense_matching.position_pairs`)
the propagated feature ``y_i`` of view 1 (online encoder and the pixel propagation module,
:class:`~ssl_lightning.heads.pixel_propagation.PixelPropagation`) is pulled to the momentum
encoder's projection ``x'_j`` of view 2, and ``y_j`` of view 2 to ``x'_i`` of view 1. As in the
authors' code (``contrast/models/PixPro.py``, ``regression_loss``), each direction is
``−2 · cos`` averaged over a sample's positive pairs (a sample without one adds 0) and over the
batch; the two directions are summed. ``−2·cos`` is the normalised squared error
``||ȳ − x̄'||²`` less its constant 2 (BYOL's form); Eq. (4) writes ``−cos``, half of it.

The optional instance branch (the authors' ``pixpro_ins_loss_weight``; 0 in their released
recipes) adds ``weight · (−2·cos(p_1, z'_2) − 2·cos(p_2, z'_1))`` between the online predictions
of the pooled instance projections and the momentum encoder's, per sample (BYOL's loss less 4).

Every term is per sample: under DDP nothing is gathered. The targets get no gradient; the loss
runs in fp32 outside autocast (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.negative_cosine import NegativeCosineLoss
from ssl_lightning.losses.numerics import at_least_fp32


class PixProLoss(nn.Module):
    """Pixel-to-propagation consistency of two views, plus the optional instance term.

    Args:
        instance_weight: Weight of the instance term (0: the pixel term alone, the authors'
            released recipes).
    """

    def __init__(self, instance_weight: float = 0.0) -> None:
        super().__init__()
        if instance_weight < 0:
            raise ValueError(f"instance_weight must be >= 0, got {instance_weight}.")
        self.instance_weight = instance_weight
        self.negative_cosine = NegativeCosineLoss()

    @staticmethod
    def direction(propagated: Tensor, target: Tensor, positives: Tensor) -> Tensor:
        """``−2 · mean cos(y_i, x'_j)`` over each sample's positive pairs ``positives[b, i, j]``
        (B, N, M), averaged over the batch: ``propagated`` (B, N, C), ``target`` (B, M, C)."""
        if propagated.dim() != 3 or target.dim() != 3 or positives.shape != (
                propagated.shape[0], propagated.shape[1], target.shape[1]):
            raise ValueError(f"Expected propagated (B, N, C), target (B, M, C) and positives "
                             f"(B, N, M), got {tuple(propagated.shape)}, {tuple(target.shape)} "
                             f"and {tuple(positives.shape)}.")
        with torch.autocast(device_type=propagated.device.type, enabled=False):
            y = F.normalize(at_least_fp32(propagated), dim=2)
            x = F.normalize(at_least_fp32(target.detach()), dim=2).to(y.dtype)
            mask = positives.to(y.dtype)
            cosine = (y @ x.transpose(1, 2) * mask).sum(dim=(1, 2))
            per_sample = cosine / mask.sum(dim=(1, 2)).clamp(min=1)
            return -2 * per_sample.mean()

    def pixel(self, propagated_1: Tensor, propagated_2: Tensor, target_1: Tensor,
              target_2: Tensor, positives: Tensor) -> Tensor:
        """The pixel term, both directions: ``positives[b, i, j]`` pairs view 1's location i
        with view 2's location j."""
        return (self.direction(propagated_1, target_2, positives)
                + self.direction(propagated_2, target_1, positives.transpose(1, 2)))

    def instance(self, prediction_1: Tensor, prediction_2: Tensor, target_1: Tensor,
                 target_2: Tensor) -> Tensor:
        """The instance term ``−2·cos(p_1, z'_2) − 2·cos(p_2, z'_1)``, averaged over the batch."""
        return 4 * self.negative_cosine(prediction_1, prediction_2, target_1, target_2)

    def forward(self, propagated_1: Tensor, propagated_2: Tensor, target_1: Tensor,
                target_2: Tensor, positives: Tensor,
                instance: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """The pixel term plus ``instance_weight`` times the instance term of ``instance``
        ``(prediction_1, prediction_2, target_1, target_2)``, each (B, D) (needed when the
        weight is > 0)."""
        loss = self.pixel(propagated_1, propagated_2, target_1, target_2, positives)
        if self.instance_weight == 0:
            return loss
        if instance is None:
            raise ValueError("PixProLoss with instance_weight > 0 needs the instance "
                             "predictions and targets.")
        return loss + self.instance_weight * self.instance(*instance)
