"""The ReSSL loss: match the student's similarity distribution over a queue to the teacher's.

Zheng et al., "ReSSL: Relational Self-Supervised Learning with Weak Augmentation", NeurIPS 2021,
Eq. (4)-(5): with the normalised student embedding ``z`` of a strongly augmented view, the
normalised EMA-teacher embedding ``t`` of a weakly augmented view and a queue ``Q`` of earlier
teacher embeddings,

``p_t = softmax(t Qᵀ / τ_t)``, ``p_s = softmax(z Qᵀ / τ_s)``, ``L = −Σ_k p_t,k log p_s,k``

(τ_t = 0.04 sharper than τ_s = 0.1), averaged over the samples. The target is a relation (how a
sample relates to the others), not the sample's own embedding. The queue is identical on every
rank and each rank averages over its own samples, so the mean over ranks is the single-process
loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


class ReSSLLoss(nn.Module):
    """Cross-entropy between the teacher's and the student's softmax similarities to a queue.

    Args:
        student_temperature: τ_s > 0 of the student's softmax (0.1 in the paper).
        teacher_temperature: τ_t > 0 of the teacher's softmax (0.04 in the paper).
    """

    def __init__(self, student_temperature: float = 0.1,
                 teacher_temperature: float = 0.04) -> None:
        super().__init__()
        for name, value in [("student_temperature", student_temperature),
                            ("teacher_temperature", teacher_temperature)]:
            if value <= 0:
                raise ValueError(f"ReSSLLoss {name} must be > 0, got {value}.")
        self.student_temperature = student_temperature
        self.teacher_temperature = teacher_temperature

    def forward(self, student: Tensor, teacher: Tensor, queue: Tensor) -> Tensor:
        """Mean over this rank's samples, in fp32 (float64 for float64 inputs).

        Args:
            student: Student embeddings of the strong view (B, D), any norm.
            teacher: Teacher embeddings of the weak view (B, D), any norm; no gradient.
            queue: Teacher embeddings of earlier batches (K, D), any norm.
        """
        if student.dim() != 2 or student.shape != teacher.shape \
                or student.shape[1:] != queue.shape[1:]:
            raise ValueError(f"ReSSLLoss: shapes {tuple(student.shape)} (student), "
                             f"{tuple(teacher.shape)} (teacher) and {tuple(queue.shape)} (queue) "
                             "do not fit; expected (B, D), (B, D) and (K, D).")
        with torch.autocast(device_type=student.device.type, enabled=False):
            s = F.normalize(at_least_fp32(student), dim=1)
            q = F.normalize(at_least_fp32(queue.detach()), dim=1).to(s.dtype)
            t = F.normalize(at_least_fp32(teacher.detach()), dim=1).to(s.dtype)
            target = (t @ q.T / self.teacher_temperature).softmax(dim=1)
            log_student = (s @ q.T / self.student_temperature).log_softmax(dim=1)
            return -(target * log_student).sum(dim=1).mean()
