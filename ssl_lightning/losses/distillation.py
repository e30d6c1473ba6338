"""Distillation from a frozen teacher: a global term against a queue of teacher embeddings, a
local term on patch-to-patch similarities, and the patch-feature regression variant.

Global term (lightly-train's distillation, after Hinton et al., "Distilling the Knowledge in a
Neural Network", 2015, with the pseudo-classifier of SEED, Fang et al., ICLR 2021): the L2-
normalised teacher embedding ``t`` and the student's projected embedding ``s`` are compared with
a queue ``Q`` of normalised teacher embeddings; with ``p_t = softmax(t Qᵀ / τ)`` and
``p_s = softmax(s Qᵀ / τ)`` the loss is ``KL(p_t ‖ p_s)`` averaged over the samples.

Local term: for each image, the normalised patch features of the teacher ``u_i`` and of the
student ``v_i`` (on the teacher's grid) give, for every patch ``i``, the distributions over the
other patches ``a_i = softmax_{j≠i}(u_i·u_j / τ)`` and ``b_i = softmax_{j≠i}(v_i·v_j / τ)``; the
loss is ``KL(a_i ‖ b_i)`` averaged over the patches and the images (the teacher's patch
affinities, as in the relational distillation of Park et al., "Relational Knowledge
Distillation", CVPR 2019).

Patch MSE (lightly-train's DistillationV2): the mean squared error between the teacher's patch
features and the student's projected ones.

Every term is a mean over this rank's own samples; the queue holds the gathered embeddings, so
under DDP the mean over ranks equals the single-process loss.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32

Variant = Literal["global", "global_local", "patch_mse"]
VARIANTS: tuple[str, ...] = ("global", "global_local", "patch_mse")


def _kl_rows(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """``KL(softmax(teacher) ‖ softmax(student))`` of every row (the last dimension)."""
    return F.kl_div(student_logits.log_softmax(-1), teacher_logits.log_softmax(-1),
                    log_target=True, reduction="none").sum(-1)


def _given(x: Tensor | None, name: str, variant: str) -> Tensor:
    if x is None:
        raise ValueError(f"The distillation variant {variant!r} needs {name}.")
    return x


def _check_temperature(temperature: float, name: str) -> None:
    if temperature <= 0:
        raise ValueError(f"{name} must be > 0, got {temperature}.")


class QueueDistillationLoss(nn.Module):
    """The global term: KL between the teacher's and the student's softmax similarities to a
    queue of teacher embeddings.

    Args:
        temperature: τ > 0 of both softmaxes (0.07, lightly-train).
    """

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        _check_temperature(temperature, "temperature")
        self.temperature = temperature

    def forward(self, student: Tensor, teacher: Tensor, queue: Tensor) -> Tensor:
        """Mean over this rank's samples.

        Args:
            student: Projected student embeddings (B, D), any norm.
            teacher: Teacher embeddings (B, D), any norm.
            queue: Normalised teacher embeddings (K, D) (the current batch's already enqueued).
        """
        if student.shape != teacher.shape or student.shape[1:] != queue.shape[1:]:
            raise ValueError(f"Shapes {tuple(student.shape)} (student), {tuple(teacher.shape)} "
                             f"(teacher) and {tuple(queue.shape)} (queue) do not fit.")
        with torch.autocast(device_type=student.device.type, enabled=False):
            queue = at_least_fp32(queue)
            s = F.normalize(at_least_fp32(student), dim=1) @ queue.T
            t = F.normalize(at_least_fp32(teacher), dim=1) @ queue.T
            return _kl_rows(t / self.temperature, s / self.temperature).mean()


class PatchSimilarityDistillationLoss(nn.Module):
    """The local term: per image, KL between the teacher's and the student's softmax
    patch-to-patch similarities (a patch's similarity to itself left out).

    Args:
        temperature: τ > 0 of both softmaxes (0.07).
    """

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        _check_temperature(temperature, "local_temperature")
        self.temperature = temperature

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Mean over this rank's images and their patches.

        Args:
            student: Student patch features (B, N, D) on the teacher's grid, any norm.
            teacher: Teacher patch features (B, N, D), any norm; N >= 2.
        """
        if student.shape != teacher.shape or student.dim() != 3 or student.shape[1] < 2:
            raise ValueError(f"Patch features must both be (B, N >= 2, D), got "
                             f"{tuple(student.shape)} (student) and {tuple(teacher.shape)} "
                             "(teacher).")
        with torch.autocast(device_type=student.device.type, enabled=False):
            s, t = (F.normalize(at_least_fp32(x), dim=-1) for x in (student, teacher))
            self_pair = torch.eye(s.shape[1], dtype=torch.bool, device=s.device)
            low = torch.finfo(s.dtype).min  # exp() of it is 0: the pair drops out of both

            def logits(x: Tensor) -> Tensor:
                return (x @ x.transpose(1, 2) / self.temperature).masked_fill(self_pair, low)

            return _kl_rows(logits(t), logits(s)).mean()


class DistillationLoss(nn.Module):
    """The terms of a distillation variant, summed.

    Args:
        variant: ``"global"`` (the queue term), ``"global_local"`` (plus ``local_weight`` × the
            patch-similarity term) or ``"patch_mse"`` (the patch-feature MSE alone).
        temperature: τ of the global term (0.07).
        local_temperature: τ of the local term (0.07).
        local_weight: Weight of the local term in ``"global_local"``.
    """

    def __init__(self, variant: Variant = "global_local", temperature: float = 0.07,
                 local_temperature: float = 0.07, local_weight: float = 1.0) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
        if local_weight < 0:
            raise ValueError(f"local_weight must be >= 0, got {local_weight}.")
        self.variant = variant
        self.local_weight = local_weight
        self.global_term = QueueDistillationLoss(temperature)
        self.local_term = PatchSimilarityDistillationLoss(local_temperature)

    def forward(self, student_global: Tensor | None, teacher_global: Tensor | None,
                queue: Tensor | None, student_patches: Tensor | None,
                teacher_patches: Tensor | None) -> Tensor:
        """The variant's loss; the inputs a variant does not use may be ``None``."""
        v = self.variant
        if v == "patch_mse":
            student, teacher = (at_least_fp32(_given(x, name, v)) for x, name in (
                (student_patches, "student_patches"), (teacher_patches, "teacher_patches")))
            with torch.autocast(device_type=student.device.type, enabled=False):
                return F.mse_loss(student, teacher)
        loss = self.global_term(_given(student_global, "student_global", v),
                                _given(teacher_global, "teacher_global", v),
                                _given(queue, "queue", v))
        if v == "global_local":
            loss = loss + self.local_weight * self.local_term(
                _given(student_patches, "student_patches", v),
                _given(teacher_patches, "teacher_patches", v))
        return loss
