"""CrIBo's object-level losses and its cycle-consistent nearest-neighbour retrieval.

Lebailly et al., "CrIBo: Self-Supervised Learning via Cross-Image Object-Level Bootstrapping",
ICLR 2024, §3.2-3.3, and the authors' ``CrIBoLoss`` / ``get_nn_centroids`` (``main_cribo.py``).
Object k of an image has a representation ``c_v^k`` in each view v (its tokens mask-pooled) and
is *valid* when it has tokens in both views. With ``H(t, s) = −Σ_j softmax((t − C)/τ_t)_j ·
log softmax(s/τ_s)_j``, the teacher's head outputs ``t``, the student's ``s`` and the EMA centre
``C`` of the teacher's object outputs:

- cross-view (object-level): ``½ (H(t_1^k, s_2^k) + H(t_2^k, s_1^k))``, averaged over the valid
  objects;
- cross-image: the nearest neighbour ``nn(c_1^k)`` (cosine) of the teacher's ``c_1^k`` among the
  view-1 objects of the memory bank is a positive for the student's ``s_2^k`` when it is
  *cycle-consistent*: the bank's view-2 representation of that neighbour has, among the view-2
  objects of the batch, ``c_2^k`` itself as nearest neighbour. ``H(h_t(nn(c_1^k)), s_2^k)`` is
  averaged over the consistent objects; the symmetric term (``nn(c_2^k)`` in the bank's view-2
  objects, back through view 1, for ``s_1^k``) likewise; the loss is the mean of the two.

The global term is DINO's [CLS] loss (:class:`~ssl_lightning.losses.DINOLoss`).

Two choices differ from the authors' code and are documented in docs/methods.md: the backward
search of the cycle runs over the objects of the global batch (the authors': each GPU's own
batch), so N processes equal one; and each direction of the cross-image term is averaged over its
own consistent objects (the authors divide both sums by the first direction's count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.distributed import all_reduce_sum_no_grad
from ssl_lightning.losses.centering import CenteredDistillationLoss, teacher_targets
from ssl_lightning.losses.numerics import at_least_fp32


@torch.no_grad()
def cycle_consistent_neighbours(
    queries: Tensor, query_valid: Tensor, own: Tensor, partners: Tensor, partner_valid: Tensor,
    bank_query_view: Tensor, bank_partner_view: Tensor, bank_valid: Tensor,
) -> tuple[Tensor, Tensor]:
    """Nearest neighbours of ``queries`` in the bank and whether each is cycle-consistent.

    Args:
        queries: Teacher objects of one view (M, D) (this rank's).
        query_valid: (M,) which queries are objects present in both views.
        own: (M,) index of each query's object among ``partners``.
        partners: The batch's teacher objects of the other view (P, D) (the global batch).
        partner_valid: (P,) which of them are objects.
        bank_query_view: The bank's objects in the queries' view (Q, D) ...
        bank_partner_view: ... and the same objects in the other view (Q, D).
        bank_valid: (Q,) which bank slots hold an object.

    Returns:
        ``(index, consistent)``: (M,) bank index of each query's nearest neighbour (cosine) and
        (M,) whether the neighbour's other-view representation has the query's own object as
        nearest neighbour among the valid partners (False for invalid queries and an empty
        bank).
    """
    dtype = torch.promote_types(queries.dtype, torch.float32)
    with torch.autocast(device_type=queries.device.type, enabled=False):
        excluded = torch.finfo(dtype).min
        similarity = F.normalize(queries.to(dtype), dim=1) @ F.normalize(
            bank_query_view.to(dtype), dim=1).T
        index = similarity.masked_fill(~bank_valid[None], excluded).argmax(dim=1)
        back = F.normalize(bank_partner_view[index].to(dtype), dim=1) @ F.normalize(
            partners.to(dtype), dim=1).T
        returned = back.masked_fill(~partner_valid[None], excluded).argmax(dim=1)
    consistent = (returned == own) & query_valid & bank_valid.any()
    return index, consistent


def _divisor(count: float) -> float:
    """``count``, or 1 when it is 0 (no term: the sum is 0). Not clamped at 1: under DDP a
    rank's divisor is the global count over the number of processes, which may be below 1."""
    return count if count > 0 else 1.0


class CrIBoLoss(CenteredDistillationLoss):
    """The cross-view and cross-image object terms (module docstring), with the object centre.

    Args:
        out_dim: Outputs of the object head (CrIBo: 65536, ``out_dim_c``).
        student_temperature: τ_s of the object terms (0.1, ``student_temp_c``).
        center_momentum: Momentum of the object centre (0.9).
    """

    def __init__(self, out_dim: int, student_temperature: float = 0.1,
                 center_momentum: float = 0.9) -> None:
        super().__init__(out_dim, student_temperature, center_momentum)

    def forward(self, student: Tensor, teacher: Tensor, valid: Tensor, neighbours: Tensor,
                consistent: Tensor, teacher_temperature: float,
                counts: tuple[float, float, float] | None = None) -> tuple[Tensor, Tensor]:
        """``(cross_view, cross_image)`` of this rank's objects.

        Args:
            student: Student head outputs of the objects (B, 2, K, J), view-major in dim 1.
            teacher: Teacher head outputs of the same objects (B, 2, K, J).
            valid: (B, K) objects present in both views.
            neighbours: Teacher head outputs of the retrieved neighbours (B, 2, K, J):
                ``[:, 0]`` of ``nn(c_1)`` (target of the student's view 2), ``[:, 1]`` of
                ``nn(c_2)`` (target of view 1).
            consistent: (B, 2, K) which neighbours are cycle-consistent.
            teacher_temperature: τ_t of this step.
            counts: Divisors of the valid objects' and of each direction's consistent
                neighbours' sums (the global counts over the number of processes, so the mean
                over ranks is the global mean); None: this rank's counts.
        """
        self.check_teacher_temperature(teacher_temperature)
        if student.dim() != 4 or student.shape[1] != 2 or teacher.shape != student.shape \
                or neighbours.shape != student.shape \
                or valid.shape != (student.shape[0], student.shape[2]) \
                or consistent.shape != student.shape[:3]:
            raise ValueError(
                f"CrIBoLoss expects student/teacher/neighbour outputs (B, 2, K, J), valid (B, K) "
                f"and consistent (B, 2, K); got {tuple(student.shape)}, {tuple(teacher.shape)}, "
                f"{tuple(neighbours.shape)}, {tuple(valid.shape)}, {tuple(consistent.shape)}.")
        if counts is None:
            counts = (float(valid.sum()), float(consistent[:, 0].sum()),
                      float(consistent[:, 1].sum()))
        with torch.autocast(device_type=student.device.type, enabled=False):
            teacher = at_least_fp32(teacher.detach())
            targets = self.targets(teacher, teacher_temperature)
            near = self.targets(at_least_fp32(neighbours.detach()), teacher_temperature)
            log_p = F.log_softmax(at_least_fp32(student) / self.student_temperature, dim=-1)
            swapped = log_p.flip(1)  # the student's other view
            view = -(targets * swapped).sum(dim=-1)  # (B, 2, K)
            cross_view = torch.where(valid[:, None], view, 0.0).sum() / 2 / _divisor(counts[0])
            image = torch.where(consistent, -(near * swapped).sum(dim=-1), 0.0)
            cross_image = (image[:, 0].sum() / _divisor(counts[1])
                           + image[:, 1].sum() / _divisor(counts[2])) / 2
        if self.training:
            self.update_center(teacher, valid)
        return cross_view, cross_image

    def targets(self, teacher: Tensor, temperature: float) -> Tensor:
        """Centred, sharpened teacher distributions of fp32 outputs (..., J)."""
        return teacher_targets(teacher.flatten(0, -2), temperature, "center",
                               self.center).view_as(teacher)

    @torch.no_grad()
    def update_center(self, teacher: Tensor, valid: Tensor) -> None:
        """``C ← m·C + (1 − m)·mean`` of the teacher's outputs of the valid objects of both views
        over all ranks (the authors' ``center_c``)."""
        rows = teacher[valid[:, None].expand(-1, 2, -1)]
        total = all_reduce_sum_no_grad(torch.cat([rows.sum(dim=0), rows.new_tensor(
            [float(rows.shape[0])])]))
        if total[-1] > 0:
            mean = (total[:-1] / total[-1])[None]
            self.center.mul_(self.center_momentum).add_(mean, alpha=1 - self.center_momentum)
