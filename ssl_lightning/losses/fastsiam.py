"""The FastSiam loss: SimSiam's negative cosine against the mean of the other views' targets.

Pototzky et al., "FastSiam: Resource-Efficient Self-supervised Learning on a Single GPU", GCPR
2022, §3: with K views, the prediction ``p_i`` of view i is pulled towards the mean of the
stop-gradient projections of the *other* views, ``t_i = (1/(K−1))·Σ_{j≠i} sg(z_j)``, and
``L = (1/K)·Σ_i −cos(p_i, t_i)``, averaged over the batch. With K = 2 it is SimSiam's
symmetrised loss. Every term is per sample: under DDP no gathering is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


class FastSiamLoss(nn.Module):
    """Mean over views and samples of ``−cos(p_i, mean_{j≠i} sg(z_j))``; in [−1, 1]."""

    def forward(self, predictions: Sequence[Tensor], projections: Sequence[Tensor]) -> Tensor:
        """FastSiam loss of the local batch.

        Args:
            predictions: K >= 2 predictions ``p_i`` (B, D), one per view.
            projections: The K projections ``z_i`` (B, D) of the same views; detached here.

        Returns:
            Scalar loss, computed in fp32 (float64 for float64 inputs) even under autocast.
        """
        views = len(predictions)
        shapes = {tuple(t.shape) for t in (*predictions, *projections)}
        if views < 2 or len(projections) != views or len(shapes) != 1 or predictions[0].dim() != 2:
            raise ValueError(
                "FastSiamLoss expects K >= 2 predictions and K projections, all (B, D) of one "
                f"shape, got {[tuple(t.shape) for t in predictions]} and "
                f"{[tuple(t.shape) for t in projections]}."
            )
        with torch.autocast(device_type=predictions[0].device.type, enabled=False):
            p = torch.stack([at_least_fp32(t) for t in predictions])
            z = torch.stack([at_least_fp32(t.detach()) for t in projections]).to(p.dtype)
            others = ~torch.eye(views, dtype=torch.bool, device=p.device)
            targets = torch.stack([z[others[i]].mean(dim=0) for i in range(views)])
            return -F.cosine_similarity(p, targets, dim=-1).mean()
