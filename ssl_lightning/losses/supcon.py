"""SupCon, the supervised contrastive loss.

Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020, Eq. (2) (L^sup_out): over the 2N
views of a batch, with A(i) all views but i and P(i) the views in A(i) with the label of i,

``L = (1/2N) sum_i -1/|P(i)| sum_{p in P(i)} log(exp(z_i·z_p/T) / sum_{a in A(i)} exp(z_i·z_a/T))``.

With one positive per anchor (all labels distinct) it is NT-Xent. The official code also scales
the loss by T / 0.07 (``base_temperature``); we follow the equation (a constant factor).

Written without cancellation: with ``lse_neg`` and ``lse_pos`` the log-sum-exps over the other
classes and over P(i), the anchor's loss is ``softplus(lse_neg - lse_pos) + (lse_pos - s̄_i)``,
``s̄_i = z_i · (mean of the positives) / T`` from per-class sums of the candidates; the second
term is exactly 0 for a single positive. Subtracting the full log-sum-exp from ``s̄_i`` instead
loses most fp32 digits at T = 0.07 on a nearly solved batch. Both log-sum-exps come from the
shared kernel (chunked or dense) with a class mask built block by block, never an (anchors ×
candidates) label matrix. Under DDP, candidates and their labels are gathered; each rank
averages over its own anchors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.distributed import all_gather_no_grad
from ssl_lightning.losses.chunked_contrastive import (
    ClassMask,
    check_loss_settings,
    check_rank_offset,
    chunked_logsumexp,
    class_gap_mean,
    gather_local,
)
from ssl_lightning.losses.numerics import at_least_fp32


class SupConLoss(nn.Module):
    """Supervised contrastive loss over two views with class labels.

    Args:
        temperature: Softmax temperature T > 0 (0.1 in the paper).
        chunk_size: Anchor rows per block of the chunked log-sum-exp (see
            :class:`NTXentLoss`); ``None`` for the dense logit matrix.
        gather: Gather the candidates and their labels inside the loss (see
            :class:`NTXentLoss`).
    """

    def __init__(
        self, temperature: float = 0.1, chunk_size: int | None = 1024, gather: bool = False
    ) -> None:
        super().__init__()
        check_loss_settings("SupConLoss", temperature, chunk_size)
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.gather = gather

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        labels: Tensor,
        z1_all: Tensor | None = None,
        z2_all: Tensor | None = None,
        labels_all: Tensor | None = None,
        rank_offset: int | None = None,
    ) -> Tensor:
        """Mean SupCon over the 2B local anchors.

        Args:
            z1, z2: Local embeddings of the two views, (B, D) each.
            labels: Class labels of the local samples, (B,), integers >= 0.
            z1_all, z2_all: Embeddings gathered from all ranks, (W·B, D); local when omitted.
            labels_all: Labels gathered from all ranks, (W·B,); ``labels`` when omitted.
            rank_offset: Index of this rank's first sample in the gathered tensors (rank · B);
                required under a process group of several ranks when gathered tensors are
                passed.

        Returns:
            Scalar loss, computed in fp32 (float64 for float64 inputs) even under autocast.

        Raises:
            ValueError: for unlabelled samples (label -1) anywhere in the global batch.
        """
        if z1.shape != z2.shape or z1.dim() != 2 or labels.shape != z1.shape[:1]:
            raise ValueError(f"SupConLoss expects z1, z2 (B, D) and labels (B,), got "
                             f"{tuple(z1.shape)}, {tuple(z2.shape)} and {tuple(labels.shape)}.")
        if self.gather:
            given = z1_all is not None or z2_all is not None or labels_all is not None
            (z1_all, z2_all), rank_offset = gather_local("SupConLoss", [z1, z2], rank_offset,
                                                         given)
            labels_all = all_gather_no_grad(labels)
        z1_all = z1 if z1_all is None else z1_all
        z2_all = z2 if z2_all is None else z2_all
        labels_all = labels if labels_all is None else labels_all
        batch, n_global = z1.shape[0], z1_all.shape[0]
        rank_offset = check_rank_offset(rank_offset, batch, n_global, "samples", "SupConLoss")
        if bool((labels_all < 0).any()):
            unlabelled = int((labels_all < 0).sum())
            raise ValueError(
                f"SupCon needs class labels, but {unlabelled} of the {n_global} samples of the "
                "batch have target -1 (unlabelled). Train it on a labelled dataset (an "
                "ImageFolder with class folders, CIFAR), or use a self-supervised method."
            )
        with torch.autocast(device_type=z1.device.type, enabled=False):
            anchors = F.normalize(at_least_fp32(torch.cat([z1, z2])), dim=1)
            candidates = F.normalize(at_least_fp32(torch.cat([z1_all, z2_all])), dim=1)
            candidates = candidates.to(anchors.dtype)
            local = torch.arange(batch, device=z1.device) + rank_offset
            self_index = torch.cat([local, local + n_global])
            classes, candidate_class = torch.unique(labels_all.repeat(2), return_inverse=True)
            class_sum = candidates.new_zeros(len(classes), candidates.shape[1])
            class_sum = class_sum.index_add(0, candidate_class, candidates)
            class_count = torch.bincount(candidate_class, minlength=len(classes))
            anchor_class = candidate_class[self_index]
            positives_sum = class_sum[anchor_class] - candidates[self_index]
            positives_count = (class_count[anchor_class] - 1).to(anchors.dtype)  # >= 1: other view
            mean_positive = (anchors * positives_sum).sum(dim=1) / (
                positives_count * self.temperature)
            if self.chunk_size is not None:
                return class_gap_mean(anchors, candidates, anchor_class, candidate_class,
                                      self_index, mean_positive, positives_count > 1,
                                      self.temperature, self.chunk_size)
            negatives = chunked_logsumexp(
                anchors, candidates, self.temperature, None, None,
                ClassMask(anchor_class, candidate_class, same=False))
            positives = chunked_logsumexp(
                anchors, candidates, self.temperature, self_index, None,
                ClassMask(anchor_class, candidate_class, same=True))
            # lse_A - mean_P s = softplus(lse_neg - lse_pos) + (lse_pos - mean_P s); the spread
            # term is exactly 0 for a single positive and >= log |P| otherwise.
            spread = torch.where(positives_count == 1, 0.0, positives - mean_positive)
            return (F.softplus(negatives - positives) + spread).mean()
