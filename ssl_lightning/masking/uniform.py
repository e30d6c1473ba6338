"""MAE's per-sample uniform masks and SimMIM's masks of square units, drawn on the CPU.

He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022, §3: a random subset of
the patches is kept, by argsort of uniform noise. Given per-sample seeds, each sample's noise is
a counter-based hash of its seed (:func:`~ssl_lightning.training.sample_rng.keyed_uniform`): its
mask is the same for any number of processes or micro-batches. Without them, the masks of the
*global* batch (``world_size × B`` samples) are drawn from the global CPU RNG and this rank's
rows returned (ranks share one stream: ``SSLMethod`` reseeds the CPU generator identically on
every rank for MAE).

SimMIM (Xie et al., "SimMIM: A Simple Framework for Masked Image Modeling", CVPR 2022, §3.1)
masks square units of ``unit × unit`` patches (its 32 px mask patches on 16 px ViT patches):
:class:`RandomUnitMasking` draws a :class:`RandomMasking` mask over the units and spreads each
unit's decision over its patches. Pixio (Yang et al., "In Pursuit of Pixel Supervision for
Visual Pre-training", arXiv 2512.15715, §3) masks the same way (its ``mask_grid``: 4 × 4
patches) and drops the masked patches from the encoder as MAE does:
:meth:`RandomUnitMasking.indices` gives the kept and masked patch indices.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ssl_lightning.training.sample_rng import keyed_uniform


class RandomMasking:
    """MAE masking of ``num_patches`` patches per sample at ``mask_ratio``.

    ``K = int(N · (1 − mask_ratio))`` patches are kept (the paper's code): the first K of a random
    permutation. Indices are in random order.

    Args:
        num_patches: Patches per image N.
        mask_ratio: Fraction of the patches masked, in (0, 1); at least one patch must be kept
            and one masked.
    """

    def __init__(self, num_patches: int, mask_ratio: float) -> None:
        if not 0 < mask_ratio < 1:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}.")
        num_keep = int(num_patches * (1 - mask_ratio))
        if not 0 < num_keep < num_patches:
            raise ValueError(f"mask_ratio {mask_ratio} keeps {num_keep} of {num_patches} "
                             "patches; choose a ratio that keeps at least one patch and masks "
                             "at least one.")
        self.num_patches, self.mask_ratio, self.num_keep = num_patches, mask_ratio, num_keep

    def __call__(self, batch: int, world_size: int = 1, rank: int = 0,
                 seeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(keep, masked)`` patch indices, (B, K) and (B, N − K), of this rank's samples:
        from their (B,) int64 ``seeds`` when given, else from torch's CPU RNG."""
        if seeds is not None:
            noise = keyed_uniform(seeds.cpu(), self.num_patches)
        else:
            noise = torch.rand(world_size * batch, self.num_patches)[
                rank * batch:(rank + 1) * batch]
        order = noise.argsort(dim=1)
        return order[:, :self.num_keep], order[:, self.num_keep:]

    def indices(self, batch: int, world_size: int = 1, rank: int = 0,
                seeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The same as calling it: the ``(keep, masked)`` interface it shares with
        :meth:`RandomUnitMasking.indices`."""
        return self(batch, world_size, rank, seeds)


class RandomUnitMasking:
    """SimMIM masking: a random ``mask_ratio`` of the ``unit × unit``-patch units of a
    ``grid × grid`` patch grid, as a (B, grid²) bool mask (True: masked), row-major.

    Args:
        grid: Patches per side.
        unit: Patches per side of a mask unit; it must divide ``grid`` (1: per-patch masks).
        mask_ratio: Fraction of the units masked, in (0, 1).
    """

    def __init__(self, grid: int, unit: int, mask_ratio: float) -> None:
        if unit < 1 or grid % unit:
            raise ValueError(f"The mask unit ({unit} patches per side) must divide the patch "
                             f"grid ({grid} per side); choose mask_patch_size as patch_size x a "
                             f"divisor of {grid}.")
        self.grid, self.unit = grid, unit
        self.units = RandomMasking((grid // unit) ** 2, mask_ratio)

    def __call__(self, batch: int, world_size: int = 1, rank: int = 0,
                 seeds: Tensor | None = None) -> Tensor:
        """(B, grid²) bool masks of this rank's samples, from their (B,) int64 ``seeds`` when
        given, else from torch's CPU RNG (see :class:`RandomMasking`)."""
        _, masked = self.units(batch, world_size, rank, seeds)
        side = self.grid // self.unit
        units = torch.zeros(batch, side * side, dtype=torch.bool)
        units.scatter_(1, masked, True)
        units = units.view(batch, side, 1, side, 1).expand(-1, -1, self.unit, -1, self.unit)
        return units.reshape(batch, self.grid * self.grid)

    def indices(self, batch: int, world_size: int = 1, rank: int = 0,
                seeds: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(keep, masked)`` patch indices (B, K) and (B, grid² − K) of the same masks as
        :meth:`__call__`, each in row-major order (every sample keeps the same number)."""
        masked = self(batch, world_size, rank, seeds)
        order = masked.to(torch.int8).argsort(dim=1, stable=True)
        num_keep = self.units.num_keep * self.unit ** 2
        return order[:, :num_keep], order[:, num_keep:]


def random_masking(
    batch: int, num_patches: int, mask_ratio: float, world_size: int = 1, rank: int = 0
) -> tuple[Tensor, Tensor]:
    """Deprecated: ``RandomMasking(num_patches, mask_ratio)(batch, world_size, rank)``."""
    warnings.warn("random_masking is deprecated; use ssl_lightning.masking.RandomMasking("
                  "num_patches, mask_ratio)(batch, world_size, rank).", DeprecationWarning,
                  stacklevel=2)
    return RandomMasking(num_patches, mask_ratio)(batch, world_size, rank)
