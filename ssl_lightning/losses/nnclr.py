"""The NNCLR loss: NT-Xent with the nearest neighbour from a support set as the anchor.

Dwibedi et al., "With a Little Help from My Friends: Nearest-Neighbor Contrastive Learning of
Visual Representations", ICCV 2021, Eq. (2) with the predictor of §3.2:

``L_i = -log exp(NN(z_i, Q)·p_i+ / T) / sum_k exp(NN(z_i, Q)·p_k+ / T)``,

where ``NN(z_i, Q)`` is the support-set embedding nearest to view 1's projection of sample i
(a constant: it carries no gradient), ``p+`` are the predictions of view 2, and k runs over the
*global* batch. The method symmetrises it (views swapped) and averages.

The neighbours are per anchor and the support set is identical on every rank, so under DDP each
rank scores its own neighbours against the gathered predictions (which receive the gradients
through the autograd-aware gather) and averages over its own anchors. Computing it against the
local predictions only is the solo-learn#229 bug; the DDP test catches it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.chunked_contrastive import (
    check_local_and_gathered,
    check_loss_settings,
    gather_local,
    positive_cross_entropy,
)
from ssl_lightning.losses.numerics import at_least_fp32


class NNCLRLoss(nn.Module):
    """One direction of the NNCLR loss.

    Args:
        temperature: Softmax temperature T > 0 (0.1 in the paper).
        chunk_size: Anchor rows per block of the chunked kernel; ``None`` for dense logits.
        gather: Gather the predictions inside the loss (autograd-aware all-gather): then
            ``forward`` takes this rank's (B, D) predictions and no ``rank_offset``.
        detach_neighbours: The anchors carry no gradient (NNCLR: support-set entries); False
            when they are network outputs (All4One's centroid term, Estepa et al. 2023).
    """

    def __init__(
        self, temperature: float = 0.1, chunk_size: int | None = 1024, gather: bool = False,
        detach_neighbours: bool = True,
    ) -> None:
        super().__init__()
        check_loss_settings("NNCLRLoss", temperature, chunk_size)
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.gather = gather
        self.detach_neighbours = detach_neighbours

    def forward(
        self, neighbours: Tensor, predictions_all: Tensor, rank_offset: int | None = None
    ) -> Tensor:
        """Mean loss over the local anchors.

        Args:
            neighbours: Support-set neighbours of the local view-1 projections, (B, D); detached
                unless ``detach_neighbours=False``.
            predictions_all: View-2 predictions of the global batch, (W·B, D), rank-major
                (this rank's (B, D) with ``gather=True``).
            rank_offset: Index of this rank's first sample in ``predictions_all`` (rank · B);
                required under a process group of several ranks.

        Returns:
            Scalar loss, computed in fp32 (float64 for float64 inputs) even under autocast.
        """
        if self.gather:
            (predictions_all,), rank_offset = gather_local("NNCLRLoss", [predictions_all],
                                                           rank_offset)
        rank_offset = check_local_and_gathered("NNCLRLoss", neighbours, predictions_all,
                                               rank_offset, "neighbours", "predictions")
        batch = neighbours.shape[0]
        with torch.autocast(device_type=neighbours.device.type, enabled=False):
            p = F.normalize(at_least_fp32(predictions_all), dim=1)
            anchors = neighbours.detach() if self.detach_neighbours else neighbours
            nn_ = F.normalize(at_least_fp32(anchors), dim=1).to(p.dtype)
            positive = torch.arange(batch, device=p.device) + rank_offset
            return positive_cross_entropy(
                nn_, p, positive, self.temperature, None, self.chunk_size
            )
