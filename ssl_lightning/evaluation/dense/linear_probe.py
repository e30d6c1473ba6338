"""The training loop the linear dense probes share: a grid of heads on one frozen forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ssl_lightning._lightning import pl
from ssl_lightning.evaluation.dense.frozen import (
    frozen_backbone,
    patch_features,
    real_samples,
    sliding_window,
)
from ssl_lightning.evaluation.dense.heads import HeadGrid
from ssl_lightning.evaluation.preprocessing import adopt_dense_normalisation, recorded_preprocessing
from ssl_lightning.optim import build_optimizer, run_schedule, split_decay_groups
from ssl_lightning.training.divergence import check_finite_loss


class DenseLinearProbe(pl.LightningModule):
    """Heads (BatchNorm + 1×1 conv, one per learning rate) trained together on the frozen
    backbone's patch-feature map of each batch; AdamW with a warm-up + cosine schedule.

    Training batches are ``(images, targets, sample_seeds)``; the val batches of the last
    val loader (the data modules' queries) are scored by every head with sliding-window
    inference of ``crop_size`` windows every ``stride`` pixels, and the outputs upsampled to
    the target's resolution. A subclass says what a head predicts, its loss and its metrics.

    Args:
        out_channels: Output maps of each head.
        backbone: The checkpoint's backbone class (None: rebuilt from the checkpoint).
        checkpoint: A pre-training checkpoint of any ssl_lightning method (``"random"``: the
            backbone as constructed, e.g. released weights loaded by its ``pretrained_path``).
        checkpoint_prefix: State-dict prefix of the backbone in the checkpoint.
        lrs: The learning-rate grid, one head each.
        weight_decay: AdamW weight decay of the convolution weights.
        warmup_epochs: Linear warm-up before the cosine decay.
        crop_size: Side of the sliding windows (the training crop size).
        stride: Step of the sliding windows (None: 2/3 of ``crop_size``, DINOv2/mmseg's 341
            for 512 windows).
        image_size: Side of the dummy image that measures the feature channels.
    """

    def __init__(self, out_channels: int, backbone: nn.Module | None, checkpoint: str | None,
                 checkpoint_prefix: str, lrs: Sequence[float], weight_decay: float,
                 warmup_epochs: float, crop_size: int, stride: int | None,
                 image_size: int) -> None:
        super().__init__()
        if weight_decay < 0 or warmup_epochs < 0:
            raise ValueError(f"weight_decay and warmup_epochs must be >= 0, got {weight_decay} "
                             f"and {warmup_epochs}.")
        stride = stride or max(1, round(crop_size * 2 / 3))
        if not 0 < stride <= crop_size:
            raise ValueError(f"stride must be in (0, crop_size={crop_size}], got {stride}.")
        self.backbone, self._checkpoint = frozen_backbone(backbone, checkpoint,
                                                          checkpoint_prefix, type(self).__name__)
        #: The checkpoint's preprocessing record (None: ``"random"`` or an older checkpoint).
        self.checkpoint_preprocessing = (recorded_preprocessing(self._checkpoint)
                                         if self._checkpoint is not None else None)
        with torch.no_grad():
            channels = patch_features(self.backbone, torch.zeros(1, 3, image_size, image_size)
                                      ).shape[1]
        self.heads = HeadGrid(channels, out_channels, lrs)
        self.weight_decay, self.warmup_epochs = weight_decay, warmup_epochs
        self.crop_size, self.stride = crop_size, stride
        self._seen = 0

    def setup(self, stage: str) -> None:
        """Normalise the data by the checkpoint's recorded statistics unless the data module
        was given its own (warning where they differ), and say which."""
        if self._checkpoint is not None:
            adopt_dense_normalisation(type(self).__name__, self.checkpoint_preprocessing,
                                      getattr(self.trainer, "datamodule", None),
                                      f"checkpoint {self._checkpoint!r}")

    def train(self, mode: bool = True) -> DenseLinearProbe:
        """The heads follow ``mode``; the frozen backbone stays in eval mode."""
        super().train(mode)
        self.backbone.eval()
        return self

    def head_loss(self, output: Tensor, targets: Tensor) -> Tensor:
        """One head's loss on its output map and the targets (B, H, W)."""
        raise NotImplementedError

    def predict_maps(self, outputs: list[Tensor]) -> list[Tensor]:
        """Every head's prediction maps (B, K, h, w) from its raw output (for averaging)."""
        return outputs

    def score(self, head: int, prediction: Tensor, targets: Tensor) -> None:
        """Add one head's full-resolution prediction (B, K, H, W) of real samples."""
        raise NotImplementedError

    def training_step(self, batch: tuple, batch_idx: int) -> Tensor:
        images, targets, *_ = batch
        features = patch_features(self.backbone, images)  # one frozen forward for every head
        losses = torch.stack([self.head_loss(out, targets) for out in self.heads(features)])
        loss = losses.sum()
        check_finite_loss(self, loss, batch_idx)
        self.log("train/loss", losses.mean(), prog_bar=True, on_step=True, on_epoch=True,
                 sync_dist=True, batch_size=len(images))
        return loss

    def predict(self, images: Tensor) -> list[Tensor]:
        """Every head's prediction maps at the resolution of ``images`` (sliding windows)."""
        heads = len(self.heads)
        stacked = sliding_window(
            lambda x: torch.cat(self.predict_maps(self.heads(patch_features(self.backbone, x))),
                                dim=1), images, self.crop_size, self.stride)
        return list(stacked.chunk(heads, dim=1))

    def on_validation_epoch_start(self) -> None:
        self._seen = 0

    def validation_step(self, batch: tuple, batch_idx: int, dataloader_idx: int = 0) -> None:
        last = len(self.trainer.num_val_batches) - 1
        if dataloader_idx != last:
            return
        images, targets = batch[0], batch[1]
        keep = real_samples(self.trainer, last, self._seen, len(images), images.device)
        self._seen += len(images)
        if not keep.any():
            return
        for head, maps in enumerate(self.predict(images[keep])):
            full = torch.nn.functional.interpolate(maps, size=targets.shape[-2:],
                                                   mode="bilinear", align_corners=False)
            self.score(head, full, targets[keep])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        groups = []
        for lr, head in zip(self.heads.lrs, self.heads, strict=True):
            groups += [{**g, "lr": lr} for g in split_decay_groups([head], self.weight_decay)]
        optimizer = build_optimizer("adamw", groups, lr=self.heads.lrs[0])
        scheduler = run_schedule(self.trainer, optimizer, self.warmup_epochs)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
