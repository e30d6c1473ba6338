"""DINO self-distillation loss with a centred, sharpened teacher.

Caron et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV 2021, §3.1 and
Algorithm 1: for every pair of crops (teacher crop t among the global crops, student crop s among
all crops, s ≠ t), ``H(P_t, P_s) = −Σ_k P_t[k] log P_s[k]`` with
``P_t = softmax((g_t − c)/τ_t)`` and ``P_s = softmax(g_s/τ_s)``; the loss is the mean over the
batch and over the number of pairs. The centre ``c`` is an EMA (momentum m, 0.9) of the batch
mean of the teacher outputs, updated *after* the loss.

Under DDP each rank averages over its own samples while the centre uses the batch mean averaged
over ranks, so the loss (mean over ranks), its gradients and the centre equal the single-process
ones on the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.distributed import all_reduce_mean_no_grad
from ssl_lightning.losses.centering import (
    CenteredDistillationLoss,
    teacher_targets,
)
from ssl_lightning.losses.numerics import at_least_fp32


class DINOLoss(CenteredDistillationLoss):
    """Cross-entropy between centred/sharpened teacher and student distributions over crop pairs.

    The centre is a persistent fp32 buffer (saved in checkpoints; ``.double()`` makes it float64
    for float64 checks); it is updated in :meth:`forward` while the module is in training mode.

    Args:
        out_dim: Number of prototypes K (size of the head output).
        student_temperature: τ_s > 0 (0.1).
        center_momentum: m in [0, 1) of the centre EMA (0.9).
        centering: ``"center"`` (the EMA centre above) or ``"sinkhorn"`` (DINOv2's Sinkhorn-Knopp
            targets over all crops and ranks; the centre is then not updated).
        sinkhorn_iterations: Sinkhorn rounds (3).
    """

    def forward(
        self, student: Sequence[Tensor], teacher: Sequence[Tensor], teacher_temperature: float
    ) -> Tensor:
        """Mean DINO loss over this rank's samples.

        Args:
            student: Student head outputs, one (B, K) tensor per crop; the first
                ``len(teacher)`` crops are the global crops the teacher saw, in the same order.
            teacher: Teacher head outputs (no gradient needed), one (B, K) tensor per global crop.
            teacher_temperature: τ_t > 0 for this step (the method applies the warm-up).

        Returns:
            Scalar loss in fp32, or float64 for float64 inputs (half inputs are promoted).
        """
        self.check_teacher_temperature(teacher_temperature)
        if len(teacher) < 1 or len(student) < 2 or len(student) < len(teacher):
            raise ValueError(
                f"DINOLoss needs >= 1 teacher crop and >= 2 student crops including the teacher's"
                f", got {len(teacher)} teacher and {len(student)} student crops."
            )
        with torch.autocast(device_type=self.center.device.type, enabled=False):
            teacher_out = torch.stack([at_least_fp32(t.detach()) for t in teacher])
            targets = teacher_targets(
                teacher_out.flatten(0, 1), teacher_temperature, self.centering, self.center,
                self.sinkhorn_iterations,
            ).view_as(teacher_out)
            total = teacher_out.new_zeros(())
            terms = 0
            for s_idx, s in enumerate(student):
                log_p = F.log_softmax(at_least_fp32(s) / self.student_temperature, dim=-1)
                for t_idx in range(len(teacher)):
                    if t_idx == s_idx:
                        continue
                    total = total + (-(targets[t_idx] * log_p).sum(dim=-1)).mean()
                    terms += 1
            loss = total / terms
        if self.training and self.centering == "center":
            self.update_center(teacher_out)
        return loss

    @torch.no_grad()
    def update_center(self, teacher: Tensor) -> None:
        """``c ← m·c + (1 − m)·mean(teacher)``, the mean over all crops, samples and ranks."""
        local_mean = at_least_fp32(teacher).flatten(0, -2).mean(dim=0, keepdim=True)
        batch_center = all_reduce_mean_no_grad(local_mean)
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)
