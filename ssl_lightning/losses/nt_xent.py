"""NT-Xent, the normalised temperature-scaled cross-entropy of SimCLR, with two options.

Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations", ICML 2020,
Eq. (1): for a positive pair (i, j) among 2N augmented samples,
``l(i, j) = -log exp(sim(z_i, z_j)/T) / sum_{k != i} exp(sim(z_i, z_k)/T)``, and the loss is the
mean of l(i, j) and l(j, i) over all N pairs (both directions).

Options (both off by default):

- ``margin`` m: an additive margin on the positive cosine, ``sim(z_i, z_j) - m`` before the
  temperature, in numerator and denominator (the margin of ArcFace-style losses, as in the
  distributed InfoNCE write-up this project was seeded with).
- ``memory_bank_size`` K: the lightly-style memory bank. Each view-1 embedding is scored
  against its own view-2 embedding (the positive) and K view-2 embeddings of earlier steps (the
  negatives; the current batch is not used as negatives), ``l_i = -log exp(s_i+) /
  (exp(s_i+) + sum_k exp(z_i·b_k/T))``. After the loss, the view-2 embeddings of the *gathered*
  global batch enter the bank (a :class:`FeatureQueue`, a persistent buffer: identical on every
  rank, checkpointed, resumes exactly); only during training (when ``z1`` requires grad).

Under DDP each rank scores its own anchors against the gathered candidates (or the bank) and
averages over its own anchors; the mean over ranks is then exactly the single-process loss on
the global batch, and so are the gradients (DDP averages them over ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.chunked_contrastive import (
    check_loss_settings,
    check_two_views,
    gather_local,
    logsumexp_gap_mean,
    positive_cross_entropy,
    two_view_pairs,
)
from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.queues import FeatureQueue


class NTXentLoss(nn.Module):
    """Symmetric NT-Xent over two views, with optional candidates gathered from all ranks.

    Args:
        temperature: Softmax temperature T > 0 (0.5 in the SimCLR paper for CIFAR, 0.1-0.2 for
            ImageNet with large batches).
        chunk_size: Compute the log-sum-exp over blocks of this many anchor rows and recompute
            them in the backward pass (:func:`chunked_logsumexp`): peak memory ~chunk_size × 2WB
            × 4 bytes instead of several (2B × 2WB) matrices, and as fast or faster (README,
            Performance). ``None`` materialises the dense logit matrix.
        margin: Additive margin m >= 0 on the positive cosine (0: plain NT-Xent).
        memory_bank_size: Number of past view-2 embeddings used as negatives (0: no bank, the
            in-batch negatives of SimCLR). A multiple of the global batch.
        embedding_dim: Size of the embeddings; required with a memory bank (it sizes the
            buffer, so that a checkpoint loads before the first step).
        gather: Gather the candidates from all ranks inside the loss (autograd-aware
            all-gather) and take this rank's offset from the process group: then ``forward``
            takes only the local tensors. ``False``: the caller passes the gathered tensors
            and ``rank_offset``, as the methods do.
    """

    def __init__(
        self,
        temperature: float = 0.2,
        chunk_size: int | None = 1024,
        margin: float = 0.0,
        memory_bank_size: int = 0,
        embedding_dim: int | None = None,
        gather: bool = False,
    ) -> None:
        super().__init__()
        check_loss_settings("NTXentLoss", temperature, chunk_size)
        if not margin >= 0:
            raise ValueError(f"NTXentLoss margin must be >= 0, got {margin}.")
        if memory_bank_size < 0:
            raise ValueError(f"NTXentLoss memory_bank_size must be >= 0 (0: no bank), got "
                             f"{memory_bank_size}.")
        if memory_bank_size > 0 and embedding_dim is None:
            raise ValueError(f"NTXentLoss with memory_bank_size={memory_bank_size} needs "
                             "embedding_dim (the size of z1 and z2).")
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.margin = margin
        self.gather = gather
        self.bank = (FeatureQueue(memory_bank_size, embedding_dim)
                     if memory_bank_size > 0 and embedding_dim is not None else None)

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        z1_all: Tensor | None = None,
        z2_all: Tensor | None = None,
        rank_offset: int | None = None,
    ) -> Tensor:
        """Mean NT-Xent over the local anchors (2B, or B with a memory bank).

        Args:
            z1: Local embeddings of view 1, shape (B, D).
            z2: Local embeddings of view 2, shape (B, D); row i is the positive of ``z1[i]``.
            z1_all: View-1 embeddings gathered from all ranks, (W·B, D); ``z1`` when omitted.
            z2_all: View-2 embeddings gathered from all ranks, (W·B, D); ``z2`` when omitted.
            rank_offset: Index of this rank's first sample in the gathered tensors (rank · B);
                required under a process group of several ranks when gathered tensors are
                passed.

        Returns:
            Scalar loss, computed in fp32 (float64 for float64 inputs) even under autocast.
        """
        if self.gather:
            (z1_all, z2_all), rank_offset = gather_local(
                "NTXentLoss", [z1, z2], rank_offset, z1_all is not None or z2_all is not None)
        z1_all, z2_all, rank_offset = check_two_views("NTXentLoss", z1, z2, z1_all, z2_all,
                                                      rank_offset)
        with torch.autocast(device_type=z1.device.type, enabled=False):
            if self.bank is not None:
                return self._bank_loss(self.bank, z1, z2, z2_all)
            anchors, candidates, self_index, positive_index = two_view_pairs(
                z1, z2, z1_all, z2_all, rank_offset)
            return positive_cross_entropy(
                anchors, candidates, positive_index, self.temperature, self_index,
                self.chunk_size, self.margin,
            )

    def _bank_loss(self, bank: FeatureQueue, z1: Tensor, z2: Tensor, z2_all: Tensor) -> Tensor:
        """View-1 anchors vs their view-2 positive and the bank; then enqueue ``z2_all``."""
        anchors = F.normalize(at_least_fp32(z1), dim=1)
        positives = F.normalize(at_least_fp32(z2), dim=1).to(anchors.dtype)
        negatives = F.normalize(bank.negatives().to(anchors.dtype), dim=1)
        positive = ((anchors * positives).sum(dim=1) - self.margin) / self.temperature
        # -log(e^s+ / (e^s+ + sum_k e^s_k)) = softplus(lse_k(s_k) - s+), stable in fp32
        loss = logsumexp_gap_mean(anchors, negatives, positive, self.temperature, None,
                                  self.chunk_size)
        if z1.requires_grad:
            bank.enqueue(F.normalize(z2_all.detach(), dim=1))
        return loss
