"""Blockwise random masks over a ViT's patch grid (iBOT, DINOv2).

Bao et al., "BEiT: BERT Pre-Training of Image Transformers", ICLR 2022, Algorithm 1: rectangles
of random area (at least ``min_block_patches``) and log-uniform aspect ratio are added at random
positions until the target number of patches is masked (a rectangle that would overshoot the
target is redrawn; after ``patience`` redraws in a row without progress the image keeps fewer).
Zhou et al., "iBOT: Image BERT Pre-Training with Online Tokenizer", ICLR 2022, §3.3 / App. A:
only a fraction of the images is masked (``probability`` 0.5), each with a ratio drawn uniformly
from a range (0.1–0.5); DINOv2 (Oquab et al., TMLR 2024) uses the same range and probability.

Given per-image seeds, each image draws from a generator of its own (the masks of a sample are
then the same for any number of processes or micro-batches, see
:mod:`ssl_lightning.training.sample_rng`); without them, from torch's default CPU generator, so
restoring its state reproduces the masks. DINOv2 (``dinov2/data/collate.py``) stratifies the
ratios instead: of the ``n`` images of a batch, ``int(n · probability)`` are masked with ratios
from consecutive equal slices of the range, assigned in a random order (``order``/``total``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


class BlockMasking:
    """Draws (num_images, grid_h · grid_w) bool masks, True = masked patch (row-major order).

    Args:
        ratio: (low, high) range of the per-image mask ratio, 0 <= low <= high <= 1.
        probability: Fraction of images that are masked at all (the others get no mask).
        min_block_patches: Smallest area of one rectangle in patches (4 in BEiT/iBOT/DINOv2).
        aspect: (min, max) aspect ratio (height / width) of a rectangle, drawn log-uniformly
            (0.3, 1/0.3 in BEiT/iBOT/DINOv2).
        max_attempts: Rectangles drawn per masked image at most.
        patience: Consecutive rectangles that add nothing before an image is left as it is.
    """

    def __init__(
        self,
        ratio: tuple[float, float] = (0.1, 0.5),
        probability: float = 0.5,
        min_block_patches: int = 4,
        aspect: tuple[float, float] = (0.3, 1 / 0.3),
        max_attempts: int = 64,
        patience: int = 10,
    ) -> None:
        low, high = ratio
        if not 0 <= low <= high <= 1:
            raise ValueError(
                f"mask ratio range must satisfy 0 <= low <= high <= 1, got {tuple(ratio)}."
            )
        if not 0 <= probability <= 1:
            raise ValueError(f"mask probability must be in [0, 1], got {probability}.")
        if min_block_patches < 1:
            raise ValueError(f"min_block_patches must be >= 1, got {min_block_patches}.")
        if not 0 < aspect[0] <= aspect[1]:
            raise ValueError(f"aspect range must satisfy 0 < min <= max, got {tuple(aspect)}.")
        if max_attempts < 1 or patience < 1:
            raise ValueError(
                f"max_attempts and patience must be >= 1, got {max_attempts} and {patience}."
            )
        self.ratio = (float(low), float(high))
        self.probability = probability
        self.min_block_patches = min_block_patches
        self.log_aspect = (math.log(aspect[0]), math.log(aspect[1]))
        self.max_attempts, self.patience = max_attempts, patience

    def __call__(self, num_images: int, grid: tuple[int, int], seeds: Tensor | None = None,
                 order: Tensor | None = None, total: int | None = None) -> Tensor:
        """Masks (num_images, grid_h · grid_w) on the CPU.

        Args:
            num_images: Images to mask.
            grid: (grid_h, grid_w) patches.
            seeds: (num_images,) int64 seeds, one generator per image; None: torch's CPU
                generator.
            order: (num_images,) place of each image in a random order of ``total`` images (the
                step's): the first ``int(total · probability)`` places are masked, place ``k``
                with a ratio from the ``k``-th of as many equal slices of ``ratio`` (DINOv2's
                stratified ratios); None: each image masked with ``probability``.
            total: Images in that order (with ``order``).
        """
        grid_h, grid_w = grid
        masks = torch.zeros(num_images, grid_h, grid_w, dtype=torch.bool)
        generators = ([torch.Generator().manual_seed(int(s) & _MASK64) for s in seeds.tolist()]
                      if seeds is not None else [None] * num_images)
        low, high = self.ratio
        masked = int((total or 0) * self.probability)
        for image, generator in enumerate(generators):
            u_apply, u_ratio = torch.rand(2, generator=generator).tolist()
            if order is not None:
                place = int(order[image])
                if place >= masked:
                    continue
                u_apply, u_ratio = 0.0, (place + u_ratio) / masked
            if u_apply < self.probability:
                target = round((low + (high - low) * u_ratio) * grid_h * grid_w)
                self._fill(masks[image], target, generator)
        return masks.flatten(1)

    def _fill(self, mask: Tensor, target: int, generator: torch.Generator | None) -> None:
        """Add rectangles to ``mask`` (grid_h, grid_w) in place until ``target`` are masked."""
        grid_h, grid_w = mask.shape
        count, misses = 0, 0
        draws = torch.rand(self.max_attempts, 4, generator=generator).tolist()
        for u_area, u_aspect, u_top, u_left in draws:
            remaining = target - count
            if remaining <= 0 or misses >= self.patience:
                return
            lo, hi = sorted((self.min_block_patches, remaining))
            area = lo + (hi - lo) * u_area
            aspect = math.exp(self.log_aspect[0] + (self.log_aspect[1] - self.log_aspect[0])
                              * u_aspect)
            height, width = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if not (1 <= height <= grid_h and 1 <= width <= grid_w):
                misses += 1
                continue
            top, left = int(u_top * (grid_h - height + 1)), int(u_left * (grid_w - width + 1))
            block = mask[top:top + height, left:left + width]
            new = int((~block).sum())
            if 0 < new <= remaining:
                block.fill_(True)
                count, misses = count + new, 0
            else:
                misses += 1


class BlockMaskGenerator(BlockMasking):
    """Deprecated name of :class:`BlockMasking`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn("BlockMaskGenerator is deprecated; use ssl_lightning.masking.BlockMasking.",
                      DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)
