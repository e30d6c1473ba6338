"""Linear semantic segmentation probe (DINOv3, Siméoni et al. 2025, §6.1 / DINOv2, Oquab et
al. 2023, §7.4 "linear"): BatchNorm + 1×1 conv on the last block's patch-token map, logits
upsampled bilinearly to the mask, cross-entropy ignoring unlabeled pixels; mIoU."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.data.dense_layouts import IGNORE_INDEX
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX
from ssl_lightning.evaluation.dense.linear_probe import DenseLinearProbe
from ssl_lightning.evaluation.dense.metrics import ConfusionMatrix


class SegLinearProbe(DenseLinearProbe):
    """A grid of linear segmentation heads on a frozen backbone (see :class:`DenseLinearProbe`).

    Logs ``train/loss`` (mean over heads), ``val/miou_lr<lr>`` per head, and ``val/miou`` and
    ``val/pixel_acc`` (percent) of the best head; :attr:`results` holds every head's scores
    (per-class IoU included) after each validation. The confusion matrices are float64 pixel
    counts summed over ranks.

    Args:
        num_classes: Number of classes (ignored pixels are 255 in the data modules' masks).
        lrs: Learning rates of the heads (DINOv2/DINOv3 pick the best of a grid).
        weight_decay: AdamW weight decay.
        **others: See :class:`DenseLinearProbe`.
    """

    def __init__(self, backbone: nn.Module | None = None, num_classes: int | None = None,
                 checkpoint: str | None = None, checkpoint_prefix: str = DEFAULT_PREFIX,
                 lrs: Sequence[float] = (1e-4, 3e-4, 1e-3, 3e-3), weight_decay: float = 1e-3,
                 warmup_epochs: float = 0.0, crop_size: int = 512, stride: int | None = None,
                 image_size: int = 224) -> None:
        if num_classes is None or num_classes < 2:
            raise ValueError(f"SegLinearProbe needs num_classes >= 2 (e.g. --model.num_classes "
                             f"150 for ADE20K), got {num_classes}.")
        super().__init__(num_classes, backbone, checkpoint, checkpoint_prefix, lrs, weight_decay,
                         warmup_epochs, crop_size, stride, image_size)
        self.save_hyperparameters(ignore=["backbone"])
        self.num_classes = num_classes
        self.matrices = [ConfusionMatrix(num_classes, IGNORE_INDEX) for _ in self.heads]
        self.results: dict[str, dict[str, Tensor]] = {}

    def setup(self, stage: str) -> None:
        """Refuse heads whose class count is not the data's, before any step; adopt the
        checkpoint's normalisation (:meth:`DenseLinearProbe.setup`)."""
        super().setup(stage)
        classes = getattr(getattr(self.trainer, "datamodule", None), "num_classes", None)
        if isinstance(classes, int) and classes != self.num_classes:
            raise ValueError(f"SegLinearProbe has num_classes={self.num_classes} but the data "
                             f"has {classes}: pass --model.num_classes {classes}.")

    def head_loss(self, output: Tensor, targets: Tensor) -> Tensor:
        logits = F.interpolate(output, size=targets.shape[-2:], mode="bilinear",
                               align_corners=False)
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)

    def score(self, head: int, prediction: Tensor, targets: Tensor) -> None:
        self.matrices[head].update(prediction.argmax(dim=1), targets)

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        for matrix in self.matrices:
            matrix.counts.zero_()

    def on_validation_epoch_end(self) -> None:
        self.results = {name: matrix.compute() for name, matrix
                        in zip(self.heads.names(), self.matrices, strict=True)}
        for name, scores in self.results.items():
            self.log(f"val/miou_{name}", scores["miou"].float(), sync_dist=True)
        best = max(self.results.values(), key=lambda s: float(torch.nan_to_num(s["miou"], -1)))
        self.log("val/miou", best["miou"].float(), prog_bar=True, sync_dist=True)
        self.log("val/pixel_acc", best["pixel_acc"].float(), sync_dist=True)
