"""Matching the locations of two views' feature maps: the positives of the dense methods.

Two rules, as the dense methods use them:

- by feature similarity (DenseCL, Wang et al., CVPR 2021, §3.2 "Dense correspondence across
  views": each location of one view is paired with the location of the other view whose
  backbone feature has the highest cosine similarity; VICRegL, Bardes et al., NeurIPS 2022,
  §3.2, pairs by the smallest L2 distance of the local features);
- by position (VICRegL's location-based matching, PixPro's distance in the original image's
  coordinates): each location is paired with the location of the other view nearest in image
  coordinates (:func:`nearest_locations` on the positions), or with every location of the
  other view closer than a threshold (:func:`position_pairs`, PixPro).

Feature maps are given as location sequences (B, N, C) (a map (B, C, h, w) flattened in
row-major order, :func:`map_to_locations`). The matching is computed outside autocast in fp32 (or
float64) and carries no gradient: it only picks indices.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.data.located_views import BOX_SIZE, map_positions
from ssl_lightning.losses.numerics import at_least_fp32

Distance = Literal["cosine", "l2"]


def map_to_locations(feature_map: Tensor) -> Tensor:
    """A feature map (B, C, h, w) as its h·w locations in row-major order, (B, h·w, C)."""
    if feature_map.dim() != 4:
        raise ValueError(f"Expected a feature map (B, C, h, w), got {tuple(feature_map.shape)}.")
    return feature_map.flatten(2).transpose(1, 2)


@torch.no_grad()
def pairwise_distance(query: Tensor, key: Tensor, distance: Distance = "cosine") -> Tensor:
    """Distances (B, N, M) between the N query and M key locations of each sample: ``1 −
    cosine similarity`` or the Euclidean distance, in fp32 (float64 for float64 inputs)."""
    if query.dim() != 3 or key.dim() != 3 or len(query) != len(key) \
            or query.shape[2] != key.shape[2]:
        raise ValueError(f"Expected query (B, N, C) and key (B, M, C) locations, got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}.")
    if distance not in ("cosine", "l2"):
        raise ValueError(f"distance must be 'cosine' or 'l2', got {distance!r}.")
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = at_least_fp32(query.detach())
        k = at_least_fp32(key.detach()).to(q.dtype)
        if distance == "cosine":
            return 1 - F.normalize(q, dim=2) @ F.normalize(k, dim=2).transpose(1, 2)
        return torch.cdist(q, k)


def nearest_locations(query: Tensor, key: Tensor, distance: Distance = "cosine") -> Tensor:
    """For every query location, the index of the nearest key location of the same sample,
    (B, N) (ties: the lowest index)."""
    return pairwise_distance(query, key, distance).argmin(dim=2)


def gather_locations(values: Tensor, index: Tensor) -> Tensor:
    """``values[b, index[b, n]]`` for every sample b and query location n: (B, M, D) values and
    a (B, N) index give (B, N, D)."""
    if values.dim() != 3 or index.shape[0] != values.shape[0] or index.dim() != 2:
        raise ValueError(f"Expected values (B, M, D) and an index (B, N), got "
                         f"{tuple(values.shape)} and {tuple(index.shape)}.")
    return torch.gather(values, 1, index.unsqueeze(2).expand(-1, -1, values.shape[2]))


def best_matches(distances: Tensor, num_matches: int) -> tuple[Tensor, Tensor]:
    """The ``num_matches`` closest pairs of each sample (VICRegL's filtered nearest neighbours):
    every input location is paired with its nearest candidate, and the ``num_matches`` input
    locations with the smallest such distance are kept, closest first (ties: lowest index).

    Args:
        distances: (B, N, M) distances of N input to M candidate locations
            (:func:`pairwise_distance`).
        num_matches: Pairs kept per sample, at most N (more: all N).

    Returns:
        ``(input_index, candidate_index)``, both (B, K) with K = min(num_matches, N).
    """
    if num_matches < 1:
        raise ValueError(f"num_matches must be >= 1, got {num_matches}.")
    nearest_distance, candidate = distances.min(dim=2)
    order = torch.sort(nearest_distance, dim=1, stable=True).indices
    input_index = order[:, :min(num_matches, distances.shape[1])]
    return input_index, torch.gather(candidate, 1, input_index)


@torch.no_grad()
def position_pairs(boxes_a: Tensor, boxes_b: Tensor, height: int, width: int,
                   threshold: float) -> Tensor:
    """PixPro's positive pairs (Xie et al., CVPR 2021, §3.1): location i of view a and location
    j of view b, both (height, width) maps, pair when the distance of their centres in the
    original image, divided by the larger of the two views' bin diagonals (a bin: one map
    location's share of its crop box), is below ``threshold`` (0.7 in the paper).

    Args:
        boxes_a: Crop boxes (B, 5) of view a (:class:`~ssl_lightning.data.LocatedViews`).
        boxes_b: Crop boxes (B, 5) of view b.
        height: Rows of both feature maps.
        width: Columns of both feature maps.
        threshold: T, in units of the larger bin diagonal.

    Returns:
        Boolean (B, height·width, height·width): ``[b, i, j]`` pairs a's location i with b's
        location j (row-major order, as :func:`map_to_locations`).
    """
    if boxes_a.shape != boxes_b.shape or boxes_a.dim() != 2 or boxes_a.shape[1] != BOX_SIZE:
        raise ValueError(f"Expected two (B, {BOX_SIZE}) crop boxes of LocatedViews, got "
                         f"{tuple(boxes_a.shape)} and {tuple(boxes_b.shape)}.")
    dtype = torch.promote_types(boxes_a.dtype, torch.float32)
    boxes_a, boxes_b = boxes_a.to(dtype), boxes_b.to(dtype)
    distance = torch.cdist(map_positions(boxes_a, height, width),
                           map_positions(boxes_b, height, width),
                           compute_mode="donot_use_mm_for_euclid_dist")  # exact differences
    diagonal = torch.maximum(*(torch.hypot(boxes[:, 2] / height, boxes[:, 3] / width)
                               for boxes in (boxes_a, boxes_b)))
    return distance < threshold * diagonal[:, None, None]
