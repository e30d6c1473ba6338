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

The cross-crop form (lightly-train's ``dinov31``, :func:`cross_crop_patches`): a student local crop
and the teacher's global crop it lies in are compared over the image region both cover, each
view's feature map RoI-aligned onto the local crop's patch grid over that region
(:func:`~ssl_lightning.losses.region_align.align_region`), so that patch i of both is the same
image location; pairs whose shared region spans less than one cell of that grid are left out
(``valid``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.region_align import align_region, shared_region

#: Floor of the squared kernel norms under the square root.
EPS = 1e-6


def centred_kernels(features: Tensor) -> Tensor:
    """``H Z Zᵀ H`` for features (B, N, D): (B, N, N)."""
    kernel = features @ features.transpose(-2, -1)
    kernel = kernel - kernel.mean(dim=-1, keepdim=True)
    return kernel - kernel.mean(dim=-2, keepdim=True)


class PaKALoss(nn.Module):
    """Mean over images of ``1 − CKA`` between the student's and teacher's patch kernels."""

    def forward(self, student: Tensor, teacher: Tensor, valid: Tensor | None = None) -> Tensor:
        """Scalar loss (fp32, float64 for float64 inputs).

        Args:
            student: Student patch features (B, N, D) (or (..., N, D): every leading index is
                an image).
            teacher: Teacher patch features of the same images and patches, (..., N, D'); D'
                may differ from D.
            valid: Which images count, (...) booleans (None: all): the mean runs over them, and
                with none the loss is a differentiable 0.
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
            terms = 1 - cross / norms
            if valid is None:
                return terms.mean()
            if valid.shape != student.shape[:-2]:
                raise ValueError(f"PaKALoss valid must have the images' shape "
                                 f"{tuple(student.shape[:-2])}, got {tuple(valid.shape)}.")
            keep = valid.flatten().to(terms.dtype)
            return (terms * keep).sum() / keep.sum().clamp_min(1)


def cross_crop_patches(student_map: Tensor, student_boxes: Tensor, teacher_map: Tensor,
                       teacher_boxes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The patches of a student local crop and of the teacher's crop at the same image
    positions (lightly-train's ``dinov31`` cross-crop PaKA).

    Args:
        student_map: The student's patch map of the local crops (B, C, g, g).
        student_boxes: Their crop boxes (B, 5) (``LocatedViews``' format).
        teacher_map: The teacher's patch map of the global crops they were cut from
            (B, C', G, G').
        teacher_boxes: The global crops' boxes (B, 5).

    Returns:
        ``(student, teacher, valid)``: each map RoI-aligned over the two crops' shared region
        onto the local crop's g x g grid, (B, g², C) and (B, g², C') (row-major, in the image's
        orientation), and (B,) whether the region spans at least one grid cell of the local crop
        in each direction (elsewhere the local crop itself is sampled, and the pair is left out).
    """
    grid = student_map.shape[-1]
    if student_map.shape[-2] != grid:
        raise ValueError(f"The student's local crops need a square patch grid, got "
                         f"{tuple(student_map.shape[-2:])}.")
    region, _ = shared_region(student_boxes, teacher_boxes)
    boxes = student_boxes.to(region.dtype)
    valid = ((region[:, 2] - region[:, 0] >= boxes[:, 2] / grid)
             & (region[:, 3] - region[:, 1] >= boxes[:, 3] / grid))
    own = torch.stack([boxes[:, 0], boxes[:, 1], boxes[:, 0] + boxes[:, 2],
                       boxes[:, 1] + boxes[:, 3]], dim=1)
    region = torch.where(valid[:, None], region, own)
    return (align_region(student_map, student_boxes, region, grid),
            align_region(teacher_map, teacher_boxes, region, grid), valid)
