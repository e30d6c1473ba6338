"""What the dense probes share: the frozen backbone of a checkpoint, its patch-feature map,
sliding-window inference and the real (non-padding) samples of a val batch under DDP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from ssl_lightning._lightning import pl
from ssl_lightning.backbones.dense import dense_features
from ssl_lightning.callbacks.knn import padding_mask, val_sampler
from ssl_lightning.distributed import all_reduce_sum_no_grad, is_distributed, rank
from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint, resolve_checkpoint


def frozen_backbone(backbone: nn.Module | None, checkpoint: str | None, prefix: str,
                    owner: str) -> tuple[nn.Module, str | None]:
    """The backbone of ``checkpoint`` (or ``backbone`` as given for ``"random"``), frozen in
    eval mode (BatchNorm statistics as pre-trained), and the checkpoint's path (None for
    ``"random"``).

    Raises:
        ValueError: no checkpoint, or ``"random"`` without a backbone.
    """
    path = resolve_checkpoint(checkpoint, owner)
    if path is not None:
        backbone = backbone_from_checkpoint(path, backbone, prefix)
    elif backbone is None:
        raise ValueError(f"{owner} with checkpoint: random needs a backbone (--model.backbone).")
    backbone.requires_grad_(False)
    return backbone.eval(), path


@torch.no_grad()
def patch_features(backbone: nn.Module, images: Tensor) -> Tensor:
    """The frozen backbone's dense map ``(B, C, h, w)`` (a ViT's last-block patch tokens on
    their grid, a CNN's last stage), as float32."""
    return dense_features(backbone, images)[0].float()


def window_starts(size: int, crop: int, stride: int) -> list[int]:
    """Window offsets along one side: every ``stride`` pixels, the last one flush with the end
    (mmseg's ``slide_inference``); one window when the side fits in ``crop``."""
    if size <= crop:
        return [0]
    count = (size - crop + stride - 1) // stride + 1
    return [min(i * stride, size - crop) for i in range(count)]


def sliding_window(predict: Callable[[Tensor], Tensor], image: Tensor, crop: int,
                   stride: int) -> Tensor:
    """``predict`` (images → ``(B, K, h, w)`` maps) on ``crop``-square windows of ``image``
    ``(B, 3, H, W)``, each upsampled bilinearly to its window and averaged where windows
    overlap: ``(B, K, H, W)``."""
    height, width = image.shape[-2:]
    total: Tensor | None = None
    count = image.new_zeros(1, 1, height, width)
    for top in window_starts(height, crop, stride):
        for left in window_starts(width, crop, stride):
            window = image[..., top:top + crop, left:left + crop]
            out = F.interpolate(predict(window), size=window.shape[-2:], mode="bilinear",
                                align_corners=False)
            if total is None:
                total = image.new_zeros(len(image), out.shape[1], height, width)
            total[..., top:top + crop, left:left + crop] += out
            count[..., top:top + crop, left:left + crop] += 1
    assert total is not None
    return total / count


def real_samples(trainer: pl.Trainer | None, dataloader_idx: int, start: int,
                 count: int, device: torch.device) -> Tensor:
    """Which of a val batch's ``count`` samples (this rank's samples ``start ..``) are real and
    not the duplicates ``DistributedSampler`` pads the last batch with.

    Raises:
        ValueError: the sampler's rank is not this process's (a Trainer started inside a
            process group without ``LOCAL_RANK``/``RANK``: every process would score rank 0's
            share); checked at the first batch of each loader, a collective.
    """
    sampler = val_sampler(trainer, dataloader_idx) if trainer is not None else None
    if isinstance(sampler, DistributedSampler) and is_distributed() and start == 0:
        wrong = torch.tensor([float(sampler.rank != rank())], device=device)
        if float(all_reduce_sum_no_grad(wrong)[0]) > 0:  # every rank raises, none waits
            raise ValueError("A val sampler's rank is not its process's: set LOCAL_RANK, RANK "
                             "and WORLD_SIZE before starting the Trainer in a process group "
                             "of your own.")
    return padding_mask(start + count, sampler, device)[start:]
