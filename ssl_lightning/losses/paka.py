"""PaKA: patch kernel alignment between student and teacher dense features.

"Patch-Level Kernel Alignment for Dense Self-Supervised Learning", arXiv 2509.05606 (2025): for
each image, the linear kernels of its N patch features, ``K_s = Z_s Z_sᵀ`` and ``K_t = Z_t Z_tᵀ``
(N × N), are double-centred with ``H = I − 11ᵀ/N`` and compared by centred kernel alignment

``CKA = ⟨H K_s H, H K_t H⟩_F / (‖H K_s H‖_F · ‖H K_t H‖_F)``,  ``ℓ = mean over images of 1 − CKA``.

CKA is invariant to isotropic scaling and orthogonal transforms of either feature set: it
matches how the patches of an image relate to each other, not the features themselves. The
squared norms are clamped at 1e-6 before the square root (as lightly's
``PatchKernelAlignmentLoss``) so a constant kernel gives a finite gradient. The teacher is
detached. Each image is its own term, so the mean of equal-sized ranks' losses is the loss of
the global batch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32

#: Floor of the squared kernel norms under the square root.
EPS = 1e-6


def centred_kernels(features: Tensor) -> Tensor:
    """``H Z Zᵀ H`` for features (B, N, D): (B, N, N)."""
    kernel = features @ features.transpose(-2, -1)
    kernel = kernel - kernel.mean(dim=-1, keepdim=True)
    return kernel - kernel.mean(dim=-2, keepdim=True)


class PaKALoss(nn.Module):
    """Mean over images of ``1 − CKA`` between the student's and teacher's patch kernels."""

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Scalar loss (fp32, float64 for float64 inputs).

        Args:
            student: Student patch features (B, N, D) (or (..., N, D): every leading index is
                an image).
            teacher: Teacher patch features of the same images and patches, (..., N, D'); D'
                may differ from D.
        """
        if student.shape[:-1] != teacher.shape[:-1] or student.dim() < 3:
            raise ValueError(f"PaKALoss needs student and teacher features (B, N, D) with the "
                             f"same images and patches, got {tuple(student.shape)} and "
                             f"{tuple(teacher.shape)}.")
        if student.shape[-2] < 2:
            raise ValueError(f"PaKALoss needs >= 2 patches per image, got {student.shape[-2]}.")
        with torch.autocast(device_type=student.device.type, enabled=False):
            k_s = centred_kernels(at_least_fp32(student).flatten(0, -3))
            k_t = centred_kernels(at_least_fp32(teacher.detach()).flatten(0, -3))
            cross = (k_s * k_t).sum(dim=(1, 2))
            norms = ((k_s * k_s).sum(dim=(1, 2)).clamp_min(EPS).sqrt()
                     * (k_t * k_t).sum(dim=(1, 2)).clamp_min(EPS).sqrt())
            return (1 - cross / norms).mean()
