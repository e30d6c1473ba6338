"""Segment masks of DetCon (Hénaff et al., ICCV 2021): which segment of the image each location
of a view's feature map belongs to, as soft weights (B, N, K) for
:func:`~ssl_lightning.losses.detcon.mask_pool`.

- :func:`grid_segments`: the paper's "spatial heuristic" masks (§3.2, Table 2): the original
  image cut into a ``grid x grid`` grid of rectangles; a location belongs to the cell that holds
  its position in the original image (its view's crop box, so the masks follow each view's crop
  and flip).
- :func:`view_grid_segments`: the same grid laid over the view itself, for views without a crop
  box (both views then name the same cells; the fallback of plain two-view batches).
- :func:`segment_map_weights`: masks a dataset provides, an integer segment map per view at the
  view's resolution (cropped and flipped with the view), averaged to the feature map's locations.
- :func:`sampled_segments`: the paper's Felzenszwalb masks (segment maps of
  :class:`~ssl_lightning.data.segmented_views.FelzenszwalbViews`, cut from the original image's
  map with each view's crop box at the positions the grid masks use,
  :func:`~ssl_lightning.data.located_views.crop_segment_map`):
  each feature location takes its majority segment (:func:`location_segments`), and a fixed
  number of the segments present in the view are sampled per image, with replacement, from
  per-sample uniforms (the authors' ``detcon`` repository, ``detcon_b.py``: 16 masks, uniform
  over the masks present in the view at the feature map's resolution).

:func:`view_segments` picks one of them from what the batch carries after the views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.data.located_views import BOX_SIZE, map_positions


def grid_segments(positions: Tensor, image_size: int, grid: int) -> Tensor:
    """One-hot weights (B, N, grid²) of the grid cell holding each location's image position.

    Args:
        positions: (B, N, 2) positions (y, x) in pixels of the original image
            (:func:`~ssl_lightning.data.located_views.map_positions`).
        image_size: Side in pixels of the (square) image the positions refer to.
        grid: Cells per side.
    """
    if positions.dim() != 3 or positions.shape[2] != 2:
        raise ValueError(f"Expected positions (B, N, 2), got {tuple(positions.shape)}.")
    cell = (positions * grid / image_size).floor().long().clamp(0, grid - 1)
    return F.one_hot(cell[..., 0] * grid + cell[..., 1], grid * grid)


def view_grid_segments(batch: int, height: int, width: int, grid: int) -> Tensor:
    """One-hot weights (batch, height·width, grid²) of a grid over the view's own
    (height, width) feature map (row-major locations)."""
    rows = torch.arange(height) * grid // height
    cols = torch.arange(width) * grid // width
    cells = (rows[:, None] * grid + cols[None, :]).flatten()
    return F.one_hot(cells, grid * grid).unsqueeze(0).expand(batch, -1, -1)


def segment_map_weights(segments: Tensor, num_segments: int, height: int, width: int) -> Tensor:
    """Soft weights (B, height·width, K) from integer segment maps (B, H, W) at a view's
    resolution: each location's share of pixels of segments 0..K−1 (ids outside are ignored)."""
    if segments.dim() != 3 or segments.is_floating_point():
        raise ValueError(f"Expected integer segment maps (B, H, W), got "
                         f"{tuple(segments.shape)} of {segments.dtype}.")
    ids = segments.long()
    inside = (ids >= 0) & (ids < num_segments)
    one_hot = F.one_hot(torch.where(inside, ids, num_segments), num_segments + 1)[..., :-1]
    pooled = F.adaptive_avg_pool2d(one_hot.permute(0, 3, 1, 2).float(), (height, width))
    return pooled.flatten(2).transpose(1, 2)


def location_segments(segments: Tensor, height: int, width: int) -> Tensor:
    """(B, height·width) majority segment of each feature location of integer segment maps
    (B, H, W) with ids >= 0: location (i, j) covers rows ``r`` with ``r·height // H == i`` and
    columns ``c`` with ``c·width // W == j`` (the average pooling's blocks when the sizes
    divide); ties go to the lowest id."""
    if segments.dim() != 3 or segments.is_floating_point() or bool((segments < 0).any()):
        raise ValueError(f"Expected segment maps (B, H, W) of ids >= 0, got "
                         f"{tuple(segments.shape)} of {segments.dtype}.")
    batch, rows, cols = segments.shape
    count = int(segments.max()) + 1 if segments.numel() else 1
    location = ((torch.arange(rows, device=segments.device) * height // rows)[:, None] * width
                + (torch.arange(cols, device=segments.device) * width // cols)[None, :])
    slot = (location.flatten() * count)[None, :] + segments.flatten(1).long()
    votes = torch.zeros(batch, height * width * count, dtype=torch.int64, device=segments.device)
    votes.scatter_add_(1, slot, torch.ones_like(slot))
    return votes.view(batch, height * width, count).argmax(dim=2)


def sampled_segments(locations: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Sample M of the segments present in each view, uniformly with replacement.

    Args:
        locations: (B, N) segment id of each location (:func:`location_segments`).
        uniforms: (B, M) uniforms in [0, 1), one per sampled mask (keyed by the sample).

    Returns:
        One-hot weights (B, N, M) of the sampled segments and their ids (B, M).
    """
    count = int(locations.max()) + 1 if locations.numel() else 1
    present = torch.zeros(locations.shape[0], count, dtype=torch.int64,
                          device=locations.device).scatter_(1, locations, 1)
    rank = (uniforms.double() * present.sum(dim=1, keepdim=True)).floor().long()  # (B, M)
    ids = torch.searchsorted(present.cumsum(dim=1), rank + 1)
    return (locations[:, :, None] == ids[:, None, :]).long(), ids


def view_segments(views: Sequence[Tensor], view: int, height: int, width: int, grid: int,
                  image_size: int, num_segments: int, uniforms: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """Segment weights (B, height·width, K) of view ``view`` (0 or 1) of a two-view batch
    ``[view_1, view_2]`` (grid over each view, K = grid²), ``[view_1, view_2, box_1, box_2]``
    of :class:`~ssl_lightning.data.located_views.LocatedViews` (grid over the original image,
    K = grid²) or ``[view_1, view_2, segments_1, segments_2]`` with integer segment maps
    (B, H, W): ids 0..``num_segments``−1 are the masks (K = ``num_segments``), or, given
    ``uniforms`` (B, M), M masks sampled among the segments present (:func:`sampled_segments`,
    K = M). Also returns the sampled segments' ids (B, M), None for the fixed masks."""
    if len(views) not in (2, 4):
        raise ValueError(f"Expected two views, optionally followed by their two crop boxes or "
                         f"segment maps; got {len(views)} entries per sample.")
    batch = views[0].shape[0]
    extra = views[2 + view] if len(views) == 4 else None
    is_map = extra is not None and extra.dim() == 3 and not extra.is_floating_point()
    if uniforms is not None:
        if extra is None or not is_map:
            raise ValueError(
                "Sampled masks (sampled_masks > 0) need integer segment maps (B, H, W) after the "
                "two views: use train_transform FelzenszwalbViews, or sampled_masks: 0 for the "
                "grid masks.")
        return sampled_segments(location_segments(extra, height, width), uniforms)
    if extra is None:
        return view_grid_segments(batch, height, width, grid).to(views[0].device), None
    if extra.dim() == 2 and extra.shape[1] == BOX_SIZE:
        return grid_segments(map_positions(extra, height, width), image_size, grid), None
    if is_map:
        return segment_map_weights(extra, num_segments, height, width), None
    raise ValueError(
        f"Expected after the two views either their crop boxes (B, {BOX_SIZE}) (train_transform: "
        f"LocatedViews) or integer segment maps (B, H, W); got {tuple(extra.shape)} of "
        f"{extra.dtype}. Use LocatedViews, a transform that returns segment maps, or two views.")
