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

:func:`view_segments` picks one of the three from what the batch carries after the views.
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


def view_segments(views: Sequence[Tensor], view: int, height: int, width: int, grid: int,
                  image_size: int, num_segments: int) -> Tensor:
    """Segment weights (B, height·width, K) of view ``view`` (0 or 1) of a two-view batch
    ``[view_1, view_2]`` (grid over each view, K = grid²), ``[view_1, view_2, box_1, box_2]``
    of :class:`~ssl_lightning.data.located_views.LocatedViews` (grid over the original image,
    K = grid²) or ``[view_1, view_2, segments_1, segments_2]`` with integer segment maps
    (B, H, W) (K = ``num_segments``)."""
    if len(views) not in (2, 4):
        raise ValueError(f"Expected two views, optionally followed by their two crop boxes or "
                         f"segment maps; got {len(views)} entries per sample.")
    batch = views[0].shape[0]
    if len(views) == 2:
        return view_grid_segments(batch, height, width, grid).to(views[0].device)
    extra = views[2 + view]
    if extra.dim() == 2 and extra.shape[1] == BOX_SIZE:
        return grid_segments(map_positions(extra, height, width), image_size, grid)
    if extra.dim() == 3 and not extra.is_floating_point():
        return segment_map_weights(extra, num_segments, height, width)
    raise ValueError(
        f"Expected after the two views either their crop boxes (B, {BOX_SIZE}) (train_transform: "
        f"LocatedViews) or integer segment maps (B, H, W); got {tuple(extra.shape)} of "
        f"{extra.dtype}. Use LocatedViews, a transform that returns segment maps, or two views.")
