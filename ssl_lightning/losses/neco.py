"""NeCo: Pariza, Salehi, Burghouts, Locatello & Asano, "Near, far: Patch-ordering enhances vision
foundation models' scene understanding", ICLR 2025, §3 "Patch neighbor consistency".

For every patch ``i`` of a view (student features ``s_i``, teacher features ``t_i`` of the same
image region) and a set of M reference patches ``r_1..r_M`` (teacher features of patches drawn
from the batch), the similarities ``d^s_i = (sim(s_i, r_k))_k`` and ``d^t_i`` are sorted by a
relaxed sorting network (:mod:`ssl_lightning.losses.soft_sort`) into soft permutation matrices
``P^s_i`` (steepness β_s) and ``P^t_i`` (β_t, no gradient). The loss is the cross-entropy of the
student's over the teacher's rank distributions, averaged over samples, patches and references:

    L = − 1/(B·N·M) Σ_b Σ_i Σ_k Σ_r P^t_{b,i}[k, r] · log P^s_{b,i}[k, r].

``sim`` is the cosine similarity (the authors' ``sim_dist: cosine``) or the Euclidean distance;
either is sorted ascending, as in the authors' code.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.soft_sort import SortingNetwork, soft_sort

Similarity = Literal["cosine", "euclidean"]


def patch_similarities(patches: Tensor, references: Tensor, similarity: Similarity) -> Tensor:
    """Similarities (B, N, M) of every patch (B, N, C) to every reference patch (B, M, C) of
    the same sample: cosine similarity or Euclidean distance."""
    if similarity == "cosine":
        return F.normalize(patches, dim=-1) @ F.normalize(references, dim=-1).transpose(1, 2)
    return torch.cdist(patches, references)


class NeCoLoss(nn.Module):
    """The NeCo patch-ordering cross-entropy (module docstring).

    Args:
        student_steepness: β_s of the student's relaxed sort (100, the authors'
            ``student_steepness``).
        teacher_steepness: β_t of the teacher's (100).
        network: ``"bitonic"`` (the authors' default) or ``"odd_even"``.
        similarity: ``"cosine"`` or ``"euclidean"``.
    """

    def __init__(self, student_steepness: float = 100.0, teacher_steepness: float = 100.0,
                 network: SortingNetwork = "bitonic", similarity: Similarity = "cosine") -> None:
        super().__init__()
        if student_steepness <= 0 or teacher_steepness <= 0:
            raise ValueError(f"The steepnesses must be > 0, got student {student_steepness} and "
                             f"teacher {teacher_steepness}.")
        if network not in ("bitonic", "odd_even"):
            raise ValueError(f"network must be 'bitonic' or 'odd_even', got {network!r}.")
        if similarity not in ("cosine", "euclidean"):
            raise ValueError(f"similarity must be 'cosine' or 'euclidean', got {similarity!r}.")
        self.student_steepness = student_steepness
        self.teacher_steepness = teacher_steepness
        self.network: SortingNetwork = network
        self.similarity: Similarity = similarity

    def forward(self, student: Tensor, teacher: Tensor, references: Tensor,
                weights: Tensor | None = None) -> Tensor:
        """The loss L: the mean of :meth:`per_sample` over the samples, or its mean weighted by
        ``weights`` (B,) (0 leaves a sample out; all 0: 0 with the graph kept)."""
        losses = self.per_sample(student, teacher, references)
        if weights is None:
            return losses.mean()
        weights = weights.to(losses.dtype)
        return (losses * weights).sum() / weights.sum().clamp_min(1)

    def per_sample(self, student: Tensor, teacher: Tensor, references: Tensor) -> Tensor:
        """Each sample's loss (B,), averaged over its patches and references.

        Args:
            student: Student patch features (B, N, C) (with gradient).
            teacher: Teacher features (B, N, C) of the same N image locations.
            references: Reference patch features (B, M, C) (teacher features; no gradient).
        """
        if student.dim() != 3 or student.shape != teacher.shape or references.dim() != 3 \
                or references.shape[0] != student.shape[0] \
                or references.shape[2] != student.shape[2]:
            raise ValueError(f"Expected student and teacher patches (B, N, C) and references "
                             f"(B, M, C), got {tuple(student.shape)}, {tuple(teacher.shape)} and "
                             f"{tuple(references.shape)}.")
        with torch.autocast(device_type=student.device.type, enabled=False):
            student = at_least_fp32(student)
            references = at_least_fp32(references.detach()).to(student.dtype)
            student_ranks = soft_sort(patch_similarities(student, references, self.similarity),
                                      self.student_steepness, self.network)[1]
            with torch.no_grad():
                teacher_ranks = soft_sort(patch_similarities(
                    at_least_fp32(teacher.detach()).to(student.dtype), references,
                    self.similarity), self.teacher_steepness, self.network)[1]
            log_ranks = torch.log(student_ranks.clamp_min(torch.finfo(student.dtype).tiny))
            return -(teacher_ranks * log_ranks).sum(dim=-1).mean(dim=(1, 2))
