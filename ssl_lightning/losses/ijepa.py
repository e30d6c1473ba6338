"""The I-JEPA loss: distance between predicted and target patch representations.

Assran et al., "Self-Supervised Learning from Images with a Joint-Embedding Predictive
Architecture", CVPR 2023, Eq. (1): the average over the M target blocks and their patches of the
squared L2 distance between the predictor's output and the target encoder's representation.
The targets are the target encoder's outputs layer-normalised over the feature dimension
(without affine parameters) and get no gradient. The paper's code uses the smooth-L1 distance
(``F.smooth_l1_loss``, beta 1) averaged over all elements; both are offered.

Every sample contributes the same number of elements, so under DDP no gathering is needed.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32

Distance = Literal["mse", "smooth_l1"]


class IJEPALoss(nn.Module):
    """Mean over all elements of ``distance(prediction, LayerNorm(target))``.

    Args:
        distance: ``"mse"`` (the paper's Eq. 1, per element) or ``"smooth_l1"`` (the code).
    """

    def __init__(self, distance: Distance = "mse") -> None:
        super().__init__()
        if distance not in ("mse", "smooth_l1"):
            raise ValueError(f"distance must be 'mse' or 'smooth_l1', got {distance!r}.")
        self.distance = distance

    def forward(self, predictions: Tensor, targets: Tensor) -> Tensor:
        """Loss of the local batch.

        Args:
            predictions: Predictor outputs (B, M, n, D) for M target blocks of n patches.
            targets: Target-encoder outputs of the same patches (B, M, n, D); detached here
                and layer-normalised over D.

        Returns:
            Scalar loss, in fp32 even under autocast.
        """
        if predictions.shape != targets.shape:
            raise ValueError(f"predictions {tuple(predictions.shape)} and targets "
                             f"{tuple(targets.shape)} must have the same shape.")
        with torch.autocast(predictions.device.type, enabled=False):
            pred, target = at_least_fp32(predictions), at_least_fp32(targets.detach())
            target = F.layer_norm(target, target.shape[-1:])
            if self.distance == "mse":
                return F.mse_loss(pred, target)
            return F.smooth_l1_loss(pred, target)
