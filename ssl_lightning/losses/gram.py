"""Gram anchoring: match the patch-similarity structure of the student to a frozen Gram teacher.

Siméoni et al., "DINOv3", arXiv 2508.10104, 2025, §4.2, Eq. (3):
``L_Gram = ||X_S·X_Sᵀ − X_G·X_Gᵀ||²_F`` with ``X_S`` (student) and ``X_G`` (Gram teacher) the
(N, D) L2-normalised patch features of one global crop; like the official ``GramLoss`` the
squared differences are averaged (an MSE over the N × N entries), then over the images.

Options of the official code: ``normalize=False`` compares raw dot products;
``clamp_negatives="both"`` (``remove_neg``) sets negative similarities of both matrices to zero,
``"teacher"`` (``remove_only_teacher_neg``) those of the teacher only (the official code also
zeroes student entries where the *already clamped* teacher is negative, which never happens, so
only the teacher is clamped there too). ``token_mask`` keeps the selected patches of each image
(the official ``tokens_used: masked / unmasked``, which it offers only for one Gram matrix over
the whole local batch; here the matrix stays per image, so N processes equal one process).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32

ClampNegatives = Literal["none", "both", "teacher"]


class GramLoss(nn.Module):
    """Mean over images of the MSE between student and Gram-teacher patch Gram matrices.

    Args:
        normalize: L2-normalise every patch token before the Gram matrix (DINOv3: True).
        clamp_negatives: ``"none"`` (DINOv3's configs), ``"both"`` or ``"teacher"``: which
            Gram matrices have their negative entries set to 0.
    """

    def __init__(self, normalize: bool = True, clamp_negatives: ClampNegatives = "none") -> None:
        super().__init__()
        if clamp_negatives not in ("none", "both", "teacher"):
            raise ValueError(f"clamp_negatives must be 'none', 'both' or 'teacher', got "
                             f"{clamp_negatives!r}.")
        self.normalize, self.clamp_negatives = normalize, clamp_negatives

    def gram(self, x: Tensor) -> Tensor:
        """(B, N, N) Gram matrices of patch tokens (B, N, D), in fp32 (float64 stays)."""
        x = at_least_fp32(x)
        if self.normalize:
            x = F.normalize(x, dim=-1)
        return x @ x.transpose(-1, -2)

    def forward(self, student: Tensor, teacher: Tensor, token_mask: Tensor | None = None
                ) -> Tensor:
        """Gram loss of this rank's images.

        Args:
            student: Student patch tokens (B, N, D).
            teacher: Gram-teacher patch tokens (B, N, D') on the same patch grid (no gradient).
            token_mask: Optional (B, N) bool: the patches each image's Gram matrices use; an
                image with none selected contributes 0 (the mean stays over all B images).

        Returns:
            Scalar loss (fp32, or float64 for float64 inputs).
        """
        if student.dim() != 3 or teacher.dim() != 3 or student.shape[:2] != teacher.shape[:2]:
            raise ValueError(f"GramLoss needs student and teacher patch tokens (B, N, D) on one "
                             f"grid, got {tuple(student.shape)} and {tuple(teacher.shape)}; resize"
                             " the teacher's patch features to the student's grid.")
        if token_mask is not None and token_mask.shape != student.shape[:2]:
            raise ValueError(f"token_mask must be (B, N) = {tuple(student.shape[:2])}, got "
                             f"{tuple(token_mask.shape)}.")
        with torch.autocast(device_type=student.device.type, enabled=False):
            s, t = self.gram(student), self.gram(teacher.detach())
            if self.clamp_negatives != "none":
                t = t.clamp(min=0)
            if self.clamp_negatives == "both":
                s = s.clamp(min=0)
            squared = (s - t).square()
            if token_mask is None:
                return squared.mean()
            keep = token_mask.to(squared.dtype)
            pairs = keep.unsqueeze(2) * keep.unsqueeze(1)
            per_image = (squared * pairs).sum((1, 2)) / pairs.sum((1, 2)).clamp(min=1)
            return per_image.mean()
