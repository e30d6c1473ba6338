"""SwAV swapped-prediction loss.

Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster Assignments",
NeurIPS 2020, Eq. (1)-(3) and Algorithm 1: codes ``q`` are computed (Sinkhorn-Knopp, no gradient)
for the assigned crops only (the 2 global crops); each is predicted from every *other* crop by
``p = softmax(z^T C / τ)``; the loss is ``−Σ_k q_k log p_k`` averaged over samples and over the
``len(assigned) × (V − 1)`` (code, crop) pairs.

Past embeddings from a queue may be scored with the current prototypes and prepended to the
Sinkhorn input so that small batches still get an equipartition over enough samples; only the
batch's own codes enter the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.sinkhorn import sinkhorn_knopp


class SwAVLoss(nn.Module):
    """Swapped prediction between Sinkhorn codes of the assigned crops and all other crops.

    Args:
        temperature: τ > 0 of the prediction softmax (0.1).
        epsilon: Sinkhorn ε > 0 (0.05).
        sinkhorn_iterations: Sinkhorn rounds (3).
        crops_for_assign: Indices of the crops whose codes are targets (the global crops (0, 1)).
    """

    def __init__(
        self,
        temperature: float = 0.1,
        epsilon: float = 0.05,
        sinkhorn_iterations: int = 3,
        crops_for_assign: Sequence[int] = (0, 1),
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"SwAV temperature must be > 0, got {temperature}.")
        if not epsilon > 0:
            raise ValueError(f"SwAV sinkhorn epsilon must be > 0, got {epsilon}.")
        if sinkhorn_iterations < 1:
            raise ValueError(f"sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}.")
        if len(crops_for_assign) < 1 or min(crops_for_assign) < 0:
            raise ValueError(f"crops_for_assign must be non-empty indices, got {crops_for_assign}.")
        self.temperature = temperature
        self.epsilon = epsilon
        self.sinkhorn_iterations = sinkhorn_iterations
        self.crops_for_assign = tuple(crops_for_assign)

    def forward(
        self, scores: Sequence[Tensor], queue_scores: Sequence[Tensor] | None = None
    ) -> Tensor:
        """Mean swapped-prediction loss over this rank's samples.

        Args:
            scores: Prototype scores ``z^T C`` per crop, each (B, K), z and C L2-normalised.
            queue_scores: Optional scores of queued embeddings per assigned crop, each (Q, K);
                prepended to the Sinkhorn input (no gradient).

        Returns:
            Scalar loss in fp32, or float64 for float64 scores (half scores are promoted).
        """
        n_crops = len(scores)
        if n_crops < 2 or max(self.crops_for_assign) >= n_crops:
            raise ValueError(
                f"SwAVLoss got {n_crops} crops; needs >= 2 and the assigned crops "
                f"{self.crops_for_assign} among them."
            )
        if queue_scores is not None and len(queue_scores) != len(self.crops_for_assign):
            raise ValueError(
                f"queue_scores needs one tensor per assigned crop ({len(self.crops_for_assign)}),"
                f" got {len(queue_scores)}."
            )
        with torch.autocast(device_type=scores[0].device.type, enabled=False):
            log_probs = [F.log_softmax(at_least_fp32(s) / self.temperature, dim=1) for s in scores]
            total = log_probs[0].new_zeros(())
            for i, crop in enumerate(self.crops_for_assign):
                batch = scores[crop].shape[0]
                sinkhorn_input = scores[crop].detach()
                if queue_scores is not None:
                    sinkhorn_input = torch.cat([queue_scores[i].detach(), sinkhorn_input])
                codes = sinkhorn_knopp(sinkhorn_input, self.epsilon, self.sinkhorn_iterations)
                codes = codes[-batch:]
                for v in range(n_crops):
                    if v != crop:
                        total = total - (codes * log_probs[v]).sum(dim=1).mean()
            return total / (len(self.crops_for_assign) * (n_crops - 1))
