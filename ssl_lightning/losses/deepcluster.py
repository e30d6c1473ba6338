"""DeepCluster v2's loss: cross-entropy of every crop's prototype scores to the sample's
k-means assignment, averaged over the prototype heads.

Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster Assignments",
NeurIPS 2020, Appendix (DeepCluster v2) and the official ``main_deepclusterv2.py``: for head
``h`` with prototypes ``C_h`` set to the k-means centroids and assignments ``a_h``,
``L = 1/H sum_h mean_{crops v, samples i} CE(z_{v,i} C_h^T / tau, a_h[i])`` (tau = 0.1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DeepClusterLoss(nn.Module):
    """Args:
        temperature: tau of the prediction softmax (0.1).
    """

    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"DeepClusterLoss temperature must be > 0, got {temperature}.")
        self.temperature = temperature

    def forward(self, scores: Sequence[Tensor], assignments: Tensor) -> Tensor:
        """Args:
            scores: Per head, the prototype scores (B, V, K_h) of every sample's V crops.
            assignments: (H, B) cluster index of each sample for each head.
        """
        if len(scores) != assignments.shape[0]:
            raise ValueError(f"{len(scores)} heads of scores but {assignments.shape[0]} rows "
                             "of assignments.")
        losses = []
        for head_scores, target in zip(scores, assignments, strict=True):
            views = head_scores.shape[1]
            with torch.autocast(device_type=head_scores.device.type, enabled=False):
                logits = head_scores.float() if head_scores.dtype in (
                    torch.float16, torch.bfloat16) else head_scores
                losses.append(F.cross_entropy(logits.flatten(0, 1) / self.temperature,
                                              target.repeat_interleave(views)))
        return torch.stack(losses).mean()
