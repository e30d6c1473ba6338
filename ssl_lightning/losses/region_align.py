"""The shared image region of two views, sampled on the same grid in each view's feature map.

NeCo (Pariza et al., ICLR 2025, §3) compares a student's and a teacher's patch features of the
*same* image locations: the region both crops cover is RoI-aligned (bilinear sampling, torchvision
``roi_align`` with ``aligned=True``) into a ``grid x grid`` map in each view. The crop boxes are
those of :class:`~ssl_lightning.data.located_views.LocatedViews` (``top, left, height, width,
flipped`` in pixels of the source image); a mirrored view's grid is mirrored back so that grid
cell (row, column) is the same image location in both views.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.ops import roi_align

from ssl_lightning.data.located_views import BOX_SIZE


def shared_region(box_a: Tensor, box_b: Tensor) -> tuple[Tensor, Tensor]:
    """The intersection ``(y0, x0, y1, x1)`` (B, 4) of two views' crop boxes (B, 5) in image
    pixels, and whether it has a positive area (B,)."""
    for boxes in (box_a, box_b):
        if boxes.dim() != 2 or boxes.shape[1] != BOX_SIZE:
            raise ValueError(f"Expected crop boxes (B, {BOX_SIZE}) of LocatedViews, got "
                             f"{tuple(boxes.shape)}.")
    y0 = torch.maximum(box_a[:, 0], box_b[:, 0])
    x0 = torch.maximum(box_a[:, 1], box_b[:, 1])
    y1 = torch.minimum(box_a[:, 0] + box_a[:, 2], box_b[:, 0] + box_b[:, 2])
    x1 = torch.minimum(box_a[:, 1] + box_a[:, 3], box_b[:, 1] + box_b[:, 3])
    return torch.stack([y0, x0, y1, x1], dim=1), (y1 > y0) & (x1 > x0)


def align_region(feature_map: Tensor, boxes: Tensor | None, region: Tensor | None,
                 grid: int) -> Tensor:
    """The ``grid x grid`` RoI-aligned samples of ``region`` (B, 4) (image pixels, from
    :func:`shared_region`) in views cut by ``boxes`` (B, 5), as locations (B, grid², C) in
    row-major order. ``boxes``/``region`` None: the whole view (a batch without crop boxes)."""
    batch, _, height, width = feature_map.shape
    if boxes is None or region is None:
        rois = feature_map.new_tensor([0.0, 0.0, width, height]).expand(batch, 4)
        flipped = torch.zeros(batch, dtype=torch.bool, device=feature_map.device)
    else:
        boxes, region = boxes.to(feature_map.dtype), region.to(feature_map.dtype)
        top, left, box_h, box_w = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
        y0 = (region[:, 0] - top) / box_h * height
        y1 = (region[:, 2] - top) / box_h * height
        x0 = (region[:, 1] - left) / box_w * width
        x1 = (region[:, 3] - left) / box_w * width
        flipped = boxes[:, 4] > 0.5
        x0, x1 = torch.where(flipped, width - x1, x0), torch.where(flipped, width - x0, x1)
        rois = torch.stack([x0, y0, x1, y1], dim=1)
    index = torch.arange(batch, dtype=feature_map.dtype, device=feature_map.device)
    sampled = roi_align(feature_map, torch.cat([index[:, None], rois], dim=1), grid,
                        spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    sampled = torch.where(flipped[:, None, None, None], sampled.flip(-1), sampled)
    return sampled.flatten(2).transpose(1, 2)
