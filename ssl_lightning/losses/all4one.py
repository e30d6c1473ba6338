"""The All4One loss: neighbour, centroid and feature-redundancy terms.

Estepa et al., "All4One: Symbiotic Neighbour Contrastive Learning via Self-Attention and
Redundancy Reduction", ICCV 2023, §3 (and solo-learn's ``all4one``, whose weights are used):

- neighbour term (NNCLR, Dwibedi et al. 2021): the nearest support-set neighbour of one view's
  teacher projection is the anchor of the other view's prediction, ``L_nn = (ℓ(NN1, p2) +
  ℓ(NN2, p1)) / 2`` with ``ℓ`` the NNCLR cross-entropy at temperature T;
- centroid term: a small transformer summarises the top-k neighbours ("centroid" ``c``) and a
  shifted sequence that starts with the sample's own second prediction (``s``);
  ``L_c = (ℓ(c1, s2) + ℓ(c2, s1)) / 2``, here with gradients through both sides;
- feature term: each embedding *dimension* normalised over the global batch, the cross-correlation
  ``C_ij = Σ_b t_bi z_bj / (‖t_:i‖ ‖z_:j‖)`` of the teacher's and the student's projections
  (both view pairings), ``R = ½ √(mean_i (C_ii − 1)²) + ½ √(mean_{i≠j} C_ij²)`` (the two
  pairings averaged under each root).

``L = w_c L_c + w_nn L_nn + w_f R`` (solo-learn: 0.5, 0.5 and 0.5 × 10).

Under DDP the two contrastive terms are means over this rank's anchors against the gathered
candidates; the feature term's column norms and ``C`` are sums over the global batch through the
injected autograd-aware ``reduce_sum`` (as :class:`~ssl_lightning.losses.BarlowTwinsLoss`), so
every rank gets the same global value.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.barlow_twins import ReduceSum, _identity
from ssl_lightning.losses.nnclr import NNCLRLoss
from ssl_lightning.losses.numerics import at_least_fp32, off_diagonal


class FeatureRedundancyLoss(nn.Module):
    """All4One's feature-wise redundancy term ``R`` over the global batch (see the module)."""

    def correlation(self, teacher: Tensor, student: Tensor, reduce_sum: ReduceSum) -> Tensor:
        """The (D, D) matrix ``C`` of column-normalised ``teacher`` and ``student`` (B, D)."""
        t, s = at_least_fp32(teacher.detach()), at_least_fp32(student)
        t = t.to(torch.promote_types(t.dtype, s.dtype))
        norms = reduce_sum(torch.stack([t.pow(2).sum(0), s.pow(2).sum(0)])).sqrt()
        return reduce_sum(t.T @ s) / (norms[0][:, None] * norms[1][None, :]).clamp_min(1e-12)

    def forward(self, teacher1: Tensor, student2: Tensor, teacher2: Tensor, student1: Tensor,
                reduce_sum: ReduceSum | None = None) -> Tensor:
        """``R`` of the pairings (teacher view 1, student view 2) and (teacher 2, student 1).

        Args:
            teacher1: Teacher projections of view 1 (B, D) (no gradient); likewise teacher2.
            student2: Student projections of view 2 (B, D); likewise student1.
            reduce_sum: Sums a tensor over all ranks, differentiably (identity when omitted).
        """
        shapes = {tuple(x.shape) for x in (teacher1, student2, teacher2, student1)}
        if len(shapes) != 1 or teacher1.dim() != 2 or teacher1.shape[1] < 2:
            raise ValueError(f"FeatureRedundancyLoss expects four (B, D) tensors of one shape "
                             f"with D >= 2, got {sorted(shapes)}.")
        reduce_sum = reduce_sum or _identity
        with torch.autocast(device_type=student1.device.type, enabled=False):
            c1 = self.correlation(teacher1, student2, reduce_sum)
            c2 = self.correlation(teacher2, student1, reduce_sum)
            on = ((torch.diagonal(c1) - 1).pow(2).mean()
                  + (torch.diagonal(c2) - 1).pow(2).mean()) / 2
            off = (off_diagonal(c1).pow(2).mean() + off_diagonal(c2).pow(2).mean()) / 2
            return 0.5 * on.sqrt() + 0.5 * off.sqrt()


class All4OneLoss(nn.Module):
    """The weighted sum of the three All4One terms.

    Args:
        temperature: T of the neighbour term (solo-learn CIFAR: 0.2).
        centroid_temperature: T of the centroid term (solo-learn: 0.1).
        neighbour_weight: w_nn (0.5).
        centroid_weight: w_c (0.5).
        feature_weight: w_f (0.5 × 10 = 5).
        chunk_size: Anchor rows per block of the chunked log-sum-exp; ``None``: dense.
    """

    def __init__(self, temperature: float = 0.2, centroid_temperature: float = 0.1,
                 neighbour_weight: float = 0.5, centroid_weight: float = 0.5,
                 feature_weight: float = 5.0, chunk_size: int | None = 1024) -> None:
        super().__init__()
        for name, value in [("neighbour_weight", neighbour_weight),
                            ("centroid_weight", centroid_weight),
                            ("feature_weight", feature_weight)]:
            if value < 0:
                raise ValueError(f"All4OneLoss {name} must be >= 0, got {value}.")
        self.neighbour = NNCLRLoss(temperature, chunk_size)
        self.centroid = NNCLRLoss(centroid_temperature, chunk_size, detach_neighbours=False)
        self.feature = FeatureRedundancyLoss()
        self.weights = (neighbour_weight, centroid_weight, feature_weight)

    def forward(self, neighbours: tuple[Tensor, Tensor], predictions_all: tuple[Tensor, Tensor],
                centroids: tuple[Tensor, Tensor], shifted_all: tuple[Tensor, Tensor],
                teacher: tuple[Tensor, Tensor], student: tuple[Tensor, Tensor],
                rank_offset: int | None = None, reduce_sum: ReduceSum | None = None) -> Tensor:
        """The rank's loss; every pair holds (view 1, view 2).

        Args:
            neighbours: Nearest support-set entries of the teacher projections, (B, D) each.
            predictions_all: Student predictions of the global batch, (W·B, D) each.
            centroids: Transformer outputs over the local top-k neighbours, (B, D) each.
            shifted_all: Transformer outputs over the shifted sequences, global, (W·B, D) each.
            teacher: Local teacher projections (B, D) each (no gradient).
            student: Local student projections (B, D) each.
            rank_offset: Index of this rank's first sample in the gathered tensors.
            reduce_sum: Autograd-aware sum over ranks (identity when omitted).
        """
        w_nn, w_c, w_f = self.weights
        nn_term = (self.neighbour(neighbours[0], predictions_all[1], rank_offset)
                   + self.neighbour(neighbours[1], predictions_all[0], rank_offset)) / 2
        centroid_term = (self.centroid(centroids[0], shifted_all[1], rank_offset)
                         + self.centroid(centroids[1], shifted_all[0], rank_offset)) / 2
        feature_term = self.feature(teacher[0], student[1], teacher[1], student[0], reduce_sum)
        return w_nn * nn_term + w_c * centroid_term + w_f * feature_term

