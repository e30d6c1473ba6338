"""iBOT's masked-image-modelling loss on patch tokens.

Zhou et al., "iBOT: Image BERT Pre-Training with Online Tokenizer", ICLR 2022, Eq. (2): for every
global crop, the student sees the crop with the masked patches replaced by a mask token and
predicts, at each masked position p, the teacher's patch distribution of the unmasked crop:
``L = −Σ_{p masked} P_t[p] · log P_s[p]``, averaged over the masked patches of an image and then
over all images of all global crops (an image without masked patches contributes 0, as in the
official iBOT and DINOv2 code). ``P_s = softmax(s/τ_s)``; ``P_t`` is a centred, sharpened
softmax with the loss's own EMA centre (iBOT; the centre is the mean over all teacher patch
tokens) or Sinkhorn-Knopp over the masked patches of the global batch (DINOv2).

iBOT++ (TIPSv2, Cao et al. 2026, arXiv:2604.12012; lightly ``IBOTPlusPlusPatchLoss``) distils the
visible patches too: ``L = mean_b(masked_b + w·visible_b)``, with ``visible_b`` the same
cross-entropy averaged over the patches the student saw unmasked (0 when none). ``w = 0`` is iBOT.

Under DDP each rank averages over its own images, the centre and the Sinkhorn sums run over all
ranks, so the mean of the rank losses, its gradients and the centre equal one process's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.distributed import all_reduce_mean_no_grad, all_reduce_sum_no_grad
from ssl_lightning.losses.centering import (
    CenteredDistillationLoss,
    Centering,
    teacher_targets,
)
from ssl_lightning.losses.numerics import at_least_fp32


class IBOTPatchLoss(CenteredDistillationLoss):
    """Cross-entropy between teacher and student patch distributions at the masked positions
    (and, with ``visible_weight``, at the visible ones: iBOT++).

    Args:
        out_dim: Prototypes K of the patch head.
        student_temperature: τ_s > 0 (0.1).
        center_momentum: m in [0, 1) of the patch-centre EMA (0.9).
        centering: ``"center"`` (iBOT) or ``"sinkhorn"`` (DINOv2).
        sinkhorn_iterations: Sinkhorn rounds (3).
        visible_weight: w >= 0 of the visible-patch term (0: iBOT; iBOT++: 1.0, lightly's
            default). Needs ``centering="center"`` (the Sinkhorn targets cover masked patches).
    """

    def __init__(
        self,
        out_dim: int,
        student_temperature: float = 0.1,
        center_momentum: float = 0.9,
        centering: Centering = "center",
        sinkhorn_iterations: int = 3,
        visible_weight: float = 0.0,
    ) -> None:
        super().__init__(out_dim, student_temperature, center_momentum, centering,
                         sinkhorn_iterations)
        if not visible_weight >= 0:
            raise ValueError(f"visible_weight (IBOT: patch_visible_weight) must be >= 0 "
                             f"(0: iBOT), got {visible_weight}.")
        if visible_weight > 0 and centering != "center":
            raise ValueError(f"visible_weight={visible_weight} (iBOT++; IBOT: "
                             f"patch_visible_weight) needs centering='center', got "
                             f"{centering!r}: the Sinkhorn targets are drawn over the masked "
                             "patches only. Set visible_weight 0 or centering center.")
        self.visible_weight = visible_weight

    def forward(
        self, student: Tensor, teacher: Tensor, masks: Tensor, teacher_temperature: float
    ) -> Tensor:
        """Mean patch loss over this rank's images.

        Args:
            student: Student patch logits (B, V, N, K) of the V masked global crops.
            teacher: Teacher patch logits (B, V, N, K) of the same crops, unmasked.
            masks: (B, V, N) bool, True where the student saw the mask token.
            teacher_temperature: τ_t > 0 for this step.

        Returns:
            Scalar loss in fp32 (float64 for float64 inputs).
        """
        self.check_teacher_temperature(teacher_temperature)
        if student.shape != teacher.shape or masks.shape != student.shape[:-1]:
            raise ValueError(
                "IBOTPatchLoss needs student and teacher (B, V, N, K) and masks (B, V, N), got "
                f"{tuple(student.shape)}, {tuple(teacher.shape)} and {tuple(masks.shape)}."
            )
        masks = masks.bool()
        with torch.autocast(device_type=self.center.device.type, enabled=False):
            teacher_fp32 = at_least_fp32(teacher.detach())
            if self.centering == "sinkhorn":
                targets = torch.zeros_like(teacher_fp32)
                total = int(all_reduce_sum_no_grad(masks.sum().reshape(1)).item())
                if total > 0:
                    targets[masks] = teacher_targets(  # Sinkhorn runs in fp32
                        teacher_fp32[masks], teacher_temperature, "sinkhorn", self.center,
                        self.sinkhorn_iterations, num_samples=total,
                    ).to(targets.dtype)
            else:
                targets = teacher_targets(teacher_fp32, teacher_temperature, "center",
                                          self.center)
            log_p = F.log_softmax(at_least_fp32(student) / self.student_temperature, dim=-1)
            cross_entropy = -(targets * log_p).sum(dim=-1)
            per_patch = torch.where(masks, cross_entropy, 0.0)
            per_image = per_patch.sum(dim=-1) / masks.sum(dim=-1).clamp(min=1)
            if self.visible_weight > 0:
                visible = torch.where(masks, 0.0, cross_entropy).sum(dim=-1)
                per_image = per_image + self.visible_weight * visible / (~masks).sum(
                    dim=-1).clamp(min=1)
            loss = per_image.mean()
        if self.training and self.centering == "center":
            self.update_center(teacher_fp32)
        return loss

    @torch.no_grad()
    def update_center(self, teacher: Tensor) -> None:
        """``c ← m·c + (1 − m)·mean(teacher)`` over all patch tokens, crops, images and ranks."""
        batch_center = all_reduce_mean_no_grad(teacher.flatten(0, -2).mean(dim=0, keepdim=True))
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)
