"""The contrastive loss of MoCo v3: in-batch keys gathered from all ranks, scaled by 2T.

Chen, Xie & He, "An Empirical Study of Training Self-Supervised Vision Transformers", ICCV 2021,
Algorithm 1: ``ctr(q, k) = CrossEntropy(q·k_all^T / T, labels) · 2T`` where ``k_all`` are the
L2-normalised keys of the whole (global) batch, ``labels`` index each query's own key (offset by
the rank's position in the gathered batch), and the total loss is ``ctr(q1, k2) + ctr(q2, k1)``.
(The 2T factor follows Algorithm 1 of the paper.)

Keys come from the momentum encoder and carry no gradient, so under DDP each rank's loss is the
mean over its own queries and DDP's gradient averaging gives the global-batch gradient.
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


class MoCoV3Loss(nn.Module):
    """One direction ``ctr(q, k)`` of the MoCo v3 loss.

    Args:
        temperature: Softmax temperature T > 0 (1.0 for ResNet, 0.2 for ViT in the paper).
        gather: Gather the keys inside the loss: then ``forward`` takes this rank's (B, D) keys
            and no ``rank_offset``.
        chunk_size: Query rows per block of the chunked log-sum-exp (see
            :func:`chunked_logsumexp`); ``None`` for the dense (B × W·B) logits.
    """

    def __init__(
        self, temperature: float = 1.0, gather: bool = False, chunk_size: int | None = 1024
    ) -> None:
        super().__init__()
        check_loss_settings("MoCoV3Loss", temperature, chunk_size)
        self.temperature = temperature
        self.gather = gather
        self.chunk_size = chunk_size

    def forward(self, query: Tensor, keys_all: Tensor, rank_offset: int | None = None) -> Tensor:
        """``2T ·`` mean cross-entropy of the local queries over all gathered keys.

        Args:
            query: Local queries (B, D); gradients flow through them.
            keys_all: Keys of the global batch (W·B, D) in rank-major order (this rank's
                (B, D) with ``gather=True``); detached here.
            rank_offset: Index of this rank's first sample in ``keys_all`` (rank · B); required
                under a process group of several ranks.

        Returns:
            Scalar loss, computed in fp32 (or float64 for float64 inputs) even under autocast.
        """
        if self.gather:
            (keys_all,), rank_offset = gather_local("MoCoV3Loss", [keys_all.detach()],
                                                    rank_offset)
        rank_offset = check_local_and_gathered("MoCoV3Loss", query, keys_all, rank_offset,
                                               "queries", "keys")
        batch = query.shape[0]
        with torch.autocast(device_type=query.device.type, enabled=False):
            q = F.normalize(at_least_fp32(query), dim=1)
            k = F.normalize(at_least_fp32(keys_all.detach()).to(q.dtype), dim=1)
            labels = torch.arange(batch, device=q.device) + rank_offset
            loss = positive_cross_entropy(q, k, labels, self.temperature,
                                          chunk_size=self.chunk_size)
            return loss * (2 * self.temperature)
