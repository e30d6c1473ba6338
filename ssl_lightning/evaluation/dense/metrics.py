"""Dense-probe metrics, accumulated in float64 and summed over ranks.

- Segmentation (mmseg's definitions, which the DINOv2/DINOv3 ADE20K numbers use): a
  ``(C, C)`` confusion matrix of (target, prediction) pixel counts over the whole split;
  IoU_c = TP / (TP + FP + FN); mIoU the mean over the classes that occur in the targets or the
  predictions (a class with an empty union has no IoU); pixel accuracy = trace / total.
- Depth (Eigen et al., NIPS 2014, as the DINOv2 depth toolbox reports them): per image over its
  valid pixels (``min_depth < target <= max_depth``), RMSE = sqrt(mean((p - t)²)), AbsRel =
  mean(|p - t| / t), δ1 = share of max(p / t, t / p) < 1.25; then the mean over images.
- :func:`sig_loss`: the scale-invariant log loss of Eigen et al. (λ = 0.85), sqrt(var(g) +
  (1 - λ) mean(g)²) with g = log p - log t over the valid pixels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_lightning.distributed import all_reduce_sum_no_grad


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int,
                     ignore_index: int) -> Tensor:
    """``(C, C)`` float64 pixel counts, rows the target class, columns the predicted one;
    pixels whose target is ``ignore_index`` are left out."""
    valid = target != ignore_index
    index = target[valid].long() * num_classes + pred[valid].long()
    counts = torch.bincount(index, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).double()


def segmentation_scores(confusion: Tensor) -> dict[str, Tensor]:
    """``miou`` and ``pixel_acc`` (in percent) and ``iou`` per class (NaN where the class is in
    neither the targets nor the predictions) of a confusion matrix."""
    tp = confusion.diagonal()
    union = confusion.sum(dim=0) + confusion.sum(dim=1) - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.nan)
    total = confusion.sum()
    return {"miou": 100 * iou.nanmean(), "iou": 100 * iou,
            "pixel_acc": 100 * tp.sum() / total.clamp(min=1)}


class ConfusionMatrix:
    """A float64 confusion matrix over batches of label maps, summed over ranks on compute."""

    def __init__(self, num_classes: int, ignore_index: int) -> None:
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.counts = torch.zeros(num_classes, num_classes, dtype=torch.float64)

    def update(self, pred: Tensor, target: Tensor) -> None:
        """Add the pixels of predictions and targets of one shape (any batch layout)."""
        self.counts = self.counts.to(pred.device) + confusion_matrix(
            pred, target, self.num_classes, self.ignore_index)

    def compute(self) -> dict[str, Tensor]:
        """:func:`segmentation_scores` of every rank's pixels (a collective under DDP)."""
        return segmentation_scores(all_reduce_sum_no_grad(self.counts.clone()))


def depth_image_errors(pred: Tensor, target: Tensor, min_depth: float,
                       max_depth: float) -> Tensor:
    """``(B, 4)`` float64 rows (RMSE, AbsRel, δ1, 1) per image of ``(B, H, W)`` maps; an image
    without a valid pixel gives a row of zeros (not counted)."""
    rows = []
    for p, t in zip(pred.double(), target.double(), strict=True):
        valid = (t > min_depth) & (t <= max_depth)
        if not valid.any():
            rows.append(torch.zeros(4, dtype=torch.float64, device=pred.device))
            continue
        p, t = p[valid].clamp(min=min_depth), t[valid]
        ratio = torch.maximum(p / t, t / p)
        rows.append(torch.stack([((p - t) ** 2).mean().sqrt(), ((p - t).abs() / t).mean(),
                                 (ratio < 1.25).double().mean(), torch.ones_like(t[0])]))
    return torch.stack(rows)


def depth_scores(sums: Tensor) -> dict[str, Tensor]:
    """``rmse``, ``abs_rel`` and ``delta1`` (a fraction) from the column sums of
    :func:`depth_image_errors` rows."""
    count = sums[3].clamp(min=1)
    return {"rmse": sums[0] / count, "abs_rel": sums[1] / count, "delta1": sums[2] / count}


def sig_loss(pred: Tensor, target: Tensor, valid: Tensor, lam: float = 0.85,
             eps: float = 1e-3) -> Tensor:
    """Scale-invariant log loss over the ``valid`` pixels (see the module docstring); ``eps``
    keeps the logarithm of a zero prediction finite."""
    g = torch.log(pred[valid] + eps) - torch.log(target[valid] + eps)
    if g.numel() < 2:
        return pred.sum() * 0
    return torch.sqrt(g.var() + (1 - lam) * g.mean() ** 2)
