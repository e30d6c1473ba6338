"""NT-Xent, the normalised temperature-scaled cross-entropy of SimCLR.

Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations", ICML 2020,
Eq. (1): for a positive pair (i, j) among 2N augmented samples,
``l(i, j) = -log exp(sim(z_i, z_j)/T) / sum_{k != i} exp(sim(z_i, z_k)/T)``, and the loss is the
mean of l(i, j) and l(j, i) over all N pairs (both directions).

Under DDP each rank scores its own 2B anchors against all 2·W·B gathered candidates and
averages over its own anchors; the mean over ranks is then exactly the single-process loss on
the global batch, and so are the gradients (DDP averages them over ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.chunked_contrastive import chunked_logsumexp


class NTXentLoss(nn.Module):
    """Symmetric NT-Xent over two views, with optional candidates gathered from all ranks.

    Args:
        temperature: Softmax temperature T > 0 (0.5 in the SimCLR paper for CIFAR, 0.1-0.2 for
            ImageNet with large batches).
        chunk_size: Compute the log-sum-exp over blocks of this many anchor rows and recompute
            them in the backward pass (:func:`chunked_logsumexp`): peak memory ~chunk_size × 2WB
            × 4 bytes instead of several (2B × 2WB) matrices, and as fast or faster (README,
            Performance). ``None`` materialises the dense logit matrix.
    """

    def __init__(self, temperature: float = 0.2, chunk_size: int | None = 1024) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"NTXentLoss temperature must be > 0, got {temperature}.")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"NTXentLoss chunk_size must be >= 1 or None, got {chunk_size}.")
        self.temperature = temperature
        self.chunk_size = chunk_size

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        z1_all: Tensor | None = None,
        z2_all: Tensor | None = None,
        rank_offset: int = 0,
    ) -> Tensor:
        """Mean NT-Xent over the 2B local anchors.

        Args:
            z1: Local embeddings of view 1, shape (B, D).
            z2: Local embeddings of view 2, shape (B, D); row i is the positive of ``z1[i]``.
            z1_all: View-1 embeddings gathered from all ranks, (W·B, D); ``z1`` when omitted.
            z2_all: View-2 embeddings gathered from all ranks, (W·B, D); ``z2`` when omitted.
            rank_offset: Index of this rank's first sample in the gathered tensors (rank · B).

        Returns:
            Scalar loss, computed in fp32 even under autocast.
        """
        if z1.shape != z2.shape or z1.dim() != 2:
            raise ValueError(
                f"NTXentLoss expects two (B, D) tensors of equal shape, got {tuple(z1.shape)} "
                f"and {tuple(z2.shape)}."
            )
        z1_all = z1 if z1_all is None else z1_all
        z2_all = z2 if z2_all is None else z2_all
        batch, n_global = z1.shape[0], z1_all.shape[0]
        if rank_offset < 0 or rank_offset + batch > n_global:
            raise ValueError(
                f"rank_offset {rank_offset} with local batch {batch} does not fit in the "
                f"{n_global} gathered samples."
            )
        with torch.autocast(device_type=z1.device.type, enabled=False):
            anchors = F.normalize(torch.cat([z1, z2]).float(), dim=1)
            candidates = F.normalize(torch.cat([z1_all, z2_all]).float(), dim=1)
            local = torch.arange(batch, device=z1.device) + rank_offset
            self_index = torch.cat([local, local + n_global])
            positive_index = torch.cat([local + n_global, local])
            if self.chunk_size is not None:
                lse = chunked_logsumexp(
                    anchors, candidates, self.temperature, self_index, self.chunk_size
                )
                positives = (anchors * candidates[positive_index]).sum(dim=1) / self.temperature
                return (lse - positives).mean()
            logits = anchors @ candidates.T / self.temperature
            rows = torch.arange(2 * batch, device=z1.device)
            logits[rows, self_index] = torch.finfo(logits.dtype).min
            return F.cross_entropy(logits, positive_index)
