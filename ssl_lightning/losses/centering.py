"""Teacher targets of the self-distillation losses: a centred softmax or Sinkhorn-Knopp.

- ``"center"``: ``softmax((t − c) / τ_t)`` with an EMA centre ``c`` of the teacher outputs (Caron
  et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV 2021, §3.1; iBOT, Zhou
  et al., ICLR 2022, for the patch tokens).
- ``"sinkhorn"``: Sinkhorn-Knopp equipartition of ``exp(t / τ_t)`` over the batch (Oquab et al.,
  "DINOv2: Learning Robust Visual Features without Supervision", TMLR 2024, §4, after SwAV), with
  the sums taken over all ranks (:func:`~ssl_lightning.losses.sinkhorn.sinkhorn_knopp`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.sinkhorn import sinkhorn_knopp

Centering = Literal["center", "sinkhorn"]


def check_centering(centering: str, sinkhorn_iterations: int) -> None:
    """``ValueError`` for an unknown centering or a non-positive number of Sinkhorn rounds."""
    if centering not in ("center", "sinkhorn"):
        raise ValueError(f"centering must be 'center' or 'sinkhorn', got {centering!r}.")
    if sinkhorn_iterations < 1:
        raise ValueError(f"sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}.")


class CenteredDistillationLoss(nn.Module):
    """Shared state and checks of the self-distillation losses (DINO [CLS], iBOT patches): the
    student temperature, the persistent fp32 EMA ``center`` (1, K) and the centering choice.

    Args:
        out_dim: Prototypes K of the head.
        student_temperature: τ_s > 0 (0.1).
        center_momentum: m in [0, 1) of the centre EMA (0.9).
        centering: ``"center"`` (the EMA centre) or ``"sinkhorn"`` (DINOv2's Sinkhorn-Knopp
            targets over all rows and ranks; the centre is then not updated).
        sinkhorn_iterations: Sinkhorn rounds (3).
    """

    center: Tensor

    def __init__(
        self,
        out_dim: int,
        student_temperature: float = 0.1,
        center_momentum: float = 0.9,
        centering: Centering = "center",
        sinkhorn_iterations: int = 3,
    ) -> None:
        super().__init__()
        if out_dim < 1:
            raise ValueError(f"{type(self).__name__} out_dim must be >= 1, got {out_dim}.")
        if not student_temperature > 0:
            raise ValueError(f"student_temperature must be > 0, got {student_temperature}.")
        if not 0 <= center_momentum < 1:
            raise ValueError(f"center_momentum must be in [0, 1), got {center_momentum}.")
        check_centering(centering, sinkhorn_iterations)
        self.student_temperature, self.center_momentum = student_temperature, center_momentum
        self.centering, self.sinkhorn_iterations = centering, sinkhorn_iterations
        self.register_buffer("center", torch.zeros(1, out_dim, dtype=torch.float32))

    @staticmethod
    def check_teacher_temperature(teacher_temperature: float) -> None:
        """``ValueError`` unless this step's τ_t is > 0."""
        if not teacher_temperature > 0:
            raise ValueError(f"teacher_temperature must be > 0, got {teacher_temperature}.")


def teacher_targets(
    teacher: Tensor,
    temperature: float,
    centering: Centering,
    center: Tensor,
    sinkhorn_iterations: int = 3,
    num_samples: int | None = None,
) -> Tensor:
    """Target distributions (M, K) for fp32 teacher logits (M, K) of this rank.

    Args:
        teacher: Teacher head outputs, one row per sample (crops flattened into rows).
        temperature: τ_t > 0.
        centering: ``"center"`` (uses ``center``) or ``"sinkhorn"``.
        center: The EMA centre (1, K) (ignored by Sinkhorn).
        sinkhorn_iterations: Sinkhorn rounds (3 in DINOv2).
        num_samples: Rows over all ranks when they differ per rank (masked patches).
    """
    if centering == "sinkhorn":
        return sinkhorn_knopp(teacher, temperature, sinkhorn_iterations, num_samples)
    return F.softmax((teacher - center) / temperature, dim=-1)
