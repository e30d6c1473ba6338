"""Run a module once per resolution group of multi-crop views.

DINO's ``MultiCropWrapper`` (Caron et al., ICCV 2021) and SwAV (NeurIPS 2020) concatenate the
crops that share a resolution and run the backbone once per group instead of once per crop, which
keeps the batch large for the GPU (and, with BatchNorm, normalises each group as one batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def forward_by_resolution(module: Callable[[Tensor], Tensor], views: Sequence[Tensor]) -> Tensor:
    """``module`` applied to every view, one call per distinct (C, H, W) shape.

    Args:
        module: Maps a (N, C, H, W) batch to (N, ...) outputs.
        views: View tensors (B_v, C, H_v, W_v), e.g. 2 global + V local crops.

    Returns:
        The outputs concatenated in view order: (Σ_v B_v, ...).
    """
    if len(views) == 0:
        raise ValueError("forward_by_resolution needs at least one view, got none.")
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, view in enumerate(views):
        groups.setdefault(tuple(view.shape[1:]), []).append(index)
    outputs: list[Tensor] = [views[0].new_empty(0)] * len(views)
    for indices in groups.values():
        out = module(torch.cat([views[i] for i in indices]))
        for i, chunk in zip(indices, out.split([views[i].shape[0] for i in indices]), strict=True):
            outputs[i] = chunk
    return outputs[0] if len(views) == 1 else torch.cat(outputs)


def project_views_sample_major(backbone: Callable[[Tensor], Tensor],
                               head: Callable[[Tensor], Tensor],
                               views: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``head(backbone(view))`` of every view (backbone once per resolution, head once), laid
    out sample-major as (B, V, D), and the first view's backbone features (B, F), for methods
    whose loss compares the V views of each sample (LeJEPA, MMCR, W-MSE)."""
    batch = views[0].shape[0]
    features = forward_by_resolution(backbone, views)
    z = head(features).view(len(views), batch, -1).transpose(0, 1)
    return z, features[:batch]
