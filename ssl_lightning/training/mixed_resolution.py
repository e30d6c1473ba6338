"""Crop sizes drawn per step: DINOv3's high-resolution adaptation (mixed resolutions).

Siméoni et al., "DINOv3", arXiv 2508.10104, 2025, §5.1: in the last stage every step trains on
one pair of global / local crop sizes (and its Gram-teacher size) drawn with given ratios; the
official ``configs/train/dinov3_vit7b16_high_res_adapt.yaml`` mixes 512/112, 768/112, 768/168,
768/224, 768/336 with ratios 0.3/0.3/0.3/0.05/0.05 and Gram crops of 768 or 1152 px.

Here the data draws the crops at the largest sizes and the method resizes the step's views
(bicubic, antialiased) to the drawn sizes. The draw is a function of the step seed
``(rng_seed, epoch, batch index)`` without the rank, so every rank (and a resumed run) trains on
the same sizes, and a micro-batched step on one set of sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

Sizes = tuple[int, int, int]  # global, local, Gram teacher
NAMES = ("global", "local", "gram")


class MixedResolution:
    """Per-step ``(global, local, Gram-teacher)`` crop sizes, drawn with ``ratios``.

    Args:
        sizes: Candidate ``[global, local, gram]`` sides (e.g. ``[[512, 112, 768], ...]``); the
            data must make crops of at least the largest of each.
        ratios: Relative frequency of each candidate (normalised; default: equal).
        patch_size: The ViT's patch size; every side must be a multiple of it.

    Raises:
        ValueError: ``sizes`` is empty or malformed, a side is not a multiple of
            ``patch_size`` (naming the nearest valid sides), or ``ratios`` does not fit.
    """

    def __init__(self, sizes: Sequence[Sequence[int]],
                 ratios: Sequence[float] | None = None, patch_size: int | None = None) -> None:
        if not sizes or any(len(s) != 3 or min(s) < 1 for s in sizes):
            raise ValueError(f"mixed_resolution_sizes must be a non-empty list of [global, "
                             f"local, gram] sides >= 1, e.g. [[512, 112, 768], [768, 224, "
                             f"1152]], got {sizes}; leave it unset (null) to train on the "
                             "data's crop sizes.")
        for candidate in sizes:
            for name, side in zip(NAMES, candidate, strict=True):
                if patch_size is not None and side % patch_size:
                    lower = side // patch_size * patch_size
                    nearest = " and ".join(str(v) for v in (lower, lower + patch_size) if v)
                    raise ValueError(
                        f"mixed_resolution_sizes: the {name} side {side} of {list(candidate)} is "
                        f"not a multiple of the ViT's patch size {patch_size}; the nearest valid "
                        f"sides are {nearest}.")
        weights = list(ratios) if ratios is not None else [1.0] * len(sizes)
        if len(weights) != len(sizes) or not all(math.isfinite(w) and w >= 0 for w in weights) \
                or sum(weights) <= 0:
            raise ValueError(f"mixed_resolution_ratios must be {len(sizes)} finite, non-negative "
                             f"values with a positive sum (one per size), got {ratios}.")
        self.sizes: list[Sizes] = [(int(g), int(l_), int(t)) for g, l_, t in sizes]
        self.weights = torch.tensor(weights, dtype=torch.float64)

    def check_crops(self, crops: Sequence[int | None]) -> None:
        """``ValueError`` before training unless the data's ``(global, local, gram)`` crop sides
        (None: unknown or not made) hold the largest size of each; the views are only resized
        down."""
        for index, (name, crop) in enumerate(zip(NAMES, crops, strict=True)):
            largest = max(s[index] for s in self.sizes)
            if crop is not None and crop < largest:
                raise ValueError(
                    f"mixed_resolution_sizes asks for {name} crops of {largest} px but the data's "
                    f"train_transform makes {crop} px ones (views are only resized down): set "
                    f"its {name}_size to {largest}, or remove the larger sizes.")

    def draw(self, seed: int) -> Sizes:
        """The sizes of the step whose rank-independent seed is ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        return self.sizes[int(torch.multinomial(self.weights, 1, generator=generator))]

    @staticmethod
    def resize(views: Sequence[Tensor], num_local_crops: int, sizes: Sizes) -> list[Tensor]:
        """``[global ×2, local ×V, (gram ×2)]`` views resized to ``sizes``; a view already of
        its size is kept as it is, a smaller one is refused."""
        global_size, local_size, gram_size = sizes
        targets = [global_size] * 2 + [local_size] * num_local_crops + [gram_size] * 2
        out = []
        for view, side in zip(views, targets[:len(views)], strict=True):
            if view.shape[-1] < side or view.shape[-2] < side:
                raise ValueError(f"A {tuple(view.shape[-2:])} view cannot be resized up to "
                                 f"{side} px: make the data's crops at least as large as the "
                                 "largest mixed_resolution size.")
            out.append(view if view.shape[-2:] == (side, side) else F.interpolate(
                view, size=(side, side), mode="bicubic", align_corners=False, antialias=True))
        return out
