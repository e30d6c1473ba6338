"""CAPI's inverse-block masks: the visible patches form one rolled rectangle.

Darcet et al., "Cluster and Predict Latent Patches for Improved Masked Image Modeling",
arXiv 2502.08769, 2025, §3.4 and the official ``data.py`` (``InverseBlockMasking`` with
``roll=True``): of a ``grid × grid`` patch grid, ``K = N − int(N · mask_ratio)`` patches stay
visible. A rectangle of ``ceil(sqrt(K · a)) × ceil(sqrt(K / a))`` patches, with the aspect ratio
``a`` drawn log-uniformly in [min_aspect, 1 / min_aspect] (narrowed so the rectangle fits), is
placed at a random position; its first K patches in row-major order are the visible ones; the
mask is then rolled (cyclically shifted) by a random offset along each axis. Everything else
is masked, returned in a random order so that its first P patches are a random subset of P.

Given per-sample seeds, a sample's draws are counter-based hashes of its seed
(:func:`~ssl_lightning.training.sample_rng.keyed_uniform`): the same for any number of processes
or micro-batches. Without them, the global batch's draws come from torch's CPU generator and
this rank's rows are returned, as :class:`~ssl_lightning.masking.RandomMasking` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ssl_lightning.training.sample_rng import keyed_uniform

#: Uniforms per sample before the masked patches' order: aspect, top, left, two roll shifts.
_DRAWS = 5


class InverseBlockMasking:
    """Visible patches in one rolled rectangle on a ``grid × grid`` patch grid.

    Args:
        grid: Patches per side.
        mask_ratio: Fraction of the patches masked, in (0, 1) (CAPI: 0.65).
        min_aspect: Smallest height / width of the rectangle, in (0, 1] (0.5; the largest is its
            inverse).
        roll: Roll the mask by a random offset along each axis (the official default).
    """

    def __init__(self, grid: int, mask_ratio: float, min_aspect: float = 0.5,
                 roll: bool = True) -> None:
        if not 0 < mask_ratio < 1:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}.")
        if not 0 < min_aspect <= 1:
            raise ValueError(f"min_aspect must be in (0, 1], got {min_aspect}.")
        n = grid * grid
        self.num_keep = n - int(n * mask_ratio)
        if not 0 < self.num_keep < n:
            raise ValueError(f"mask_ratio {mask_ratio} keeps {self.num_keep} of {n} patches; "
                             "choose a ratio that keeps at least one patch and masks one.")
        self.grid, self.mask_ratio, self.roll = grid, mask_ratio, roll
        self.log_aspect = (math.log(min_aspect), -math.log(min_aspect))

    def visible(self, uniforms: list[float]) -> list[int]:
        """Sorted visible patch indices of one sample from its first draws."""
        g, k = self.grid, self.num_keep
        low = max(self.log_aspect[0], math.log(k / g ** 2))
        high = min(self.log_aspect[1], math.log(g ** 2 / (k + 1e-5)))
        aspect = math.exp(low + uniforms[0] * (high - low))
        h = min(g, math.ceil(math.sqrt(k * aspect)))
        w = min(g, math.ceil(math.sqrt(k / aspect)))
        while h * w < k:  # rounding at the clamp: grow the other side
            w, h = (w + 1, h) if w < g else (w, h + 1)
        top, left = int(uniforms[1] * (g - h + 1)), int(uniforms[2] * (g - w + 1))
        shift_r, shift_c = ((int(uniforms[3] * g), int(uniforms[4] * g)) if self.roll
                            else (0, 0))
        cells = [(top + i // w, left + i % w) for i in range(k)]
        return sorted(((r + shift_r) % g) * g + (c + shift_c) % g for r, c in cells)

    def __call__(self, batch: int, world_size: int = 1, rank: int = 0,
                 seeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(keep, masked)`` patch indices (B, K) sorted and (B, N − K) in random order, of
        this rank's samples: from their (B,) int64 ``seeds`` when given, else from torch's CPU
        generator."""
        n = self.grid * self.grid
        if seeds is not None:
            draws = keyed_uniform(seeds.cpu(), _DRAWS + n, torch.float64)
        else:
            draws = torch.rand(world_size * batch, _DRAWS + n,
                               dtype=torch.float64)[rank * batch:(rank + 1) * batch]
        keep = torch.tensor([self.visible(row[:_DRAWS].tolist()) for row in draws],
                            dtype=torch.long).view(batch, self.num_keep)
        noise = draws[:, _DRAWS:].scatter(1, keep, 2.0)  # visible patches sort last
        masked = noise.argsort(dim=1)[:, :n - self.num_keep]
        return keep, masked
