"""Symmetrised negative cosine similarity with stop-gradient, the SimSiam loss.

Chen & He, "Exploring Simple Siamese Representation Learning", CVPR 2021, Eqs. (1)-(4):
``D(p, z) = −⟨p/||p||, z/||z||⟩`` and ``L = D(p1, stopgrad(z2))/2 + D(p2, stopgrad(z1))/2``,
averaged over the batch. The stop-gradient on the targets is what prevents collapse (§4.1).

Every term is per sample, so under DDP each rank's loss is the mean over its own samples and no
gathering is needed: DDP's gradient averaging gives the global-batch gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


class NegativeCosineLoss(nn.Module):
    """Symmetrised negative cosine similarity between predictions and stop-gradient targets.

    The loss lies in [−1, 1]; −1 means every prediction points along its target.
    """

    def forward(self, p1: Tensor, p2: Tensor, z1: Tensor, z2: Tensor) -> Tensor:
        """Mean over the local batch of ``D(p1, sg(z2))/2 + D(p2, sg(z1))/2``.

        Args:
            p1: Predictions from view 1, shape (B, D).
            p2: Predictions from view 2, shape (B, D).
            z1: Projections of view 1 (targets of ``p2``; detached here), shape (B, D).
            z2: Projections of view 2 (targets of ``p1``; detached here), shape (B, D).

        Returns:
            Scalar loss, computed in fp32 even under autocast.
        """
        shapes = {tuple(t.shape) for t in (p1, p2, z1, z2)}
        if len(shapes) != 1 or p1.dim() != 2:
            raise ValueError(
                "NegativeCosineLoss expects four (B, D) tensors of equal shape, got "
                f"{[tuple(t.shape) for t in (p1, p2, z1, z2)]}."
            )
        with torch.autocast(device_type=p1.device.type, enabled=False):
            p1, p2, z1, z2 = (at_least_fp32(t) for t in (p1, p2, z1.detach(), z2.detach()))
            d1 = F.cosine_similarity(p1, z2, dim=1)
            d2 = F.cosine_similarity(p2, z1, dim=1)
            return -(d1.mean() + d2.mean()) / 2
