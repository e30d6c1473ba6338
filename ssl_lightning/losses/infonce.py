"""InfoNCE with a dictionary of negatives, the contrastive loss of MoCo v1/v2.

He et al., "Momentum Contrast for Unsupervised Visual Representation Learning", CVPR 2020,
Eq. (1): for a query q with positive key k+ and negatives {k_i},
``L_q = −log exp(q·k+/T) / (exp(q·k+/T) + Σ_i exp(q·k_i/T))`` on L2-normalised embeddings,
averaged over the queries. MoCo v2 (Chen et al., arXiv:2003.04297) keeps the loss with T = 0.2.

Every term is per query and the negatives (a queue) are the same on every rank, so under DDP
each rank's loss is the mean over its own queries and no gradient crosses ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.chunked_contrastive import check_loss_settings, logsumexp_gap_mean
from ssl_lightning.losses.numerics import at_least_fp32


class InfoNCELoss(nn.Module):
    """InfoNCE of queries against their positive keys and a shared set of negatives.

    Args:
        temperature: Softmax temperature T > 0 (0.07 in MoCo v1, 0.2 in MoCo v2).
        chunk_size: Query rows per block of the chunked log-sum-exp over the negatives (see
            :func:`logsumexp_gap_mean`); ``None`` for the dense (B × K) logits.
    """

    def __init__(self, temperature: float = 0.2, chunk_size: int | None = 1024) -> None:
        super().__init__()
        check_loss_settings("InfoNCELoss", temperature, chunk_size)
        self.temperature = temperature
        self.chunk_size = chunk_size

    def forward(self, query: Tensor, key: Tensor, negatives: Tensor) -> Tensor:
        """Mean InfoNCE over the queries.

        Args:
            query: Queries (B, D); gradients flow through them.
            key: Positive keys (B, D), row i for query i; detached here.
            negatives: Negative keys (K, D), e.g. the MoCo queue; detached here.

        Returns:
            Scalar loss, computed in fp32 (float64 for float64 inputs) even under autocast.
            Inputs are L2-normalised here.
        """
        if query.dim() != 2 or query.shape != key.shape or negatives.shape[1:] != query.shape[1:]:
            raise ValueError(
                f"InfoNCELoss expects query and key (B, D) and negatives (K, D), got "
                f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(negatives.shape)}."
            )
        with torch.autocast(device_type=query.device.type, enabled=False):
            q = F.normalize(at_least_fp32(query), dim=1)
            k = F.normalize(at_least_fp32(key.detach()).to(q.dtype), dim=1)
            n = F.normalize(at_least_fp32(negatives.detach()).to(q.dtype), dim=1)
            positive = (q * k).sum(dim=1) / self.temperature
            # -log(e^s+ / (e^s+ + sum_k e^s_k)) = softplus(lse_k(s_k) - s+), stable in fp32
            return logsumexp_gap_mean(q, n, positive, self.temperature, None, self.chunk_size)
