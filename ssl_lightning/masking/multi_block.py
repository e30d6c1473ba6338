"""I-JEPA's multi-block masks, drawn per sample on the CPU from torch's RNG.

:class:`MultiBlockMasking` (Assran et al., "Self-Supervised Learning from Images with a
Joint-Embedding Predictive Architecture", CVPR 2023, §3): M target blocks and one context block
with the target patches removed.

Given per-sample seeds, a sample's block positions and context subset are counter-based
hashes of its seed (:func:`~ssl_lightning.training.sample_rng.keyed_uniform`, one draw per
placement try): the same for any number of processes or micro-batches. Without them, like
:class:`~ssl_lightning.masking.RandomMasking`, it draws the masks of the *global* batch
(``world_size × B`` samples) from the global CPU RNG and returns this rank's rows (ranks share
one stream: ``SSLMethod`` reseeds the CPU generator identically on every rank for I-JEPA).
"""

from __future__ import annotations

import math
import random

import torch
from torch import Tensor

from ssl_lightning.training.sample_rng import derive, keyed_uniform

Range = tuple[float, float]


class MultiBlockMasking:
    """I-JEPA multi-block masks on a ``grid × grid`` patch grid.

    Per step, one target block size and one context block size are drawn from a generator
    seeded by ``(seed, step)`` — the same for every sample, rank and micro-batch of a step, as
    the paper's collator does per batch. Per sample, the positions of the ``num_targets``
    target blocks and of the context block are drawn from torch's RNG; the context keeps its
    patches outside all targets. Every sample keeps exactly ``context_count(sizes)`` context
    patches: ``max(min_context, area_context − num_targets · area_target)``, a count every
    placement reaches (placements with fewer are redrawn); a uniformly random subset is kept
    when more are free. (The official collator instead truncates each sample to the minimum over
    its batch, which depends on the other samples and the per-rank batch; ours is a function of
    the sample alone.)

    Args:
        grid: Patches per side.
        num_targets: Target blocks M (4).
        target_scale: Area range of a target block as a fraction of the grid (0.15, 0.2).
        target_aspect: Height/width range of the target blocks (0.75, 1.5).
        context_scale: Area range of the context block (0.85, 1.0); its aspect is 1.
        min_context: Fewest context patches kept (the official ``min_keep``, 10).
        seed: Seed of the per-step block-size generator.
        max_tries: Placement redraws before giving up with an error.
    """

    def __init__(
        self,
        grid: int,
        num_targets: int = 4,
        target_scale: Range = (0.15, 0.2),
        target_aspect: Range = (0.75, 1.5),
        context_scale: Range = (0.85, 1.0),
        min_context: int = 10,
        seed: int = 0,
        max_tries: int = 100,
    ) -> None:
        for name, (low, high) in (("target_scale", target_scale),
                                  ("context_scale", context_scale)):
            if not 0 < low <= high <= 1:
                raise ValueError(f"{name} must satisfy 0 < min <= max <= 1, got {(low, high)}.")
        if not 0 < target_aspect[0] <= target_aspect[1]:
            raise ValueError(f"target_aspect must satisfy 0 < min <= max, got {target_aspect}.")
        if num_targets < 1 or min_context < 1:
            raise ValueError(f"num_targets and min_context must be >= 1, got {num_targets} and "
                             f"{min_context}.")
        self.grid, self.num_targets, self.min_context = grid, num_targets, min_context
        self.target_scale, self.target_aspect = target_scale, target_aspect
        self.context_scale, self.seed, self.max_tries = context_scale, seed, max_tries
        n = grid * grid
        largest_target = max(self.block(target_scale[1], a) for a in target_aspect)
        smallest_context = self.block(context_scale[0], 1.0)
        if int(n * target_scale[0]) < 1:
            raise ValueError(f"target_scale {target_scale} gives target blocks of no patch on a "
                             f"{grid}x{grid} grid; raise the scale or use smaller patches.")
        if (smallest_context[0] * smallest_context[1] < min_context
                or n - largest_target[0] * largest_target[1] < min_context):
            raise ValueError(
                f"Blocks do not fit the {grid}x{grid} patch grid: target blocks up to "
                f"{largest_target} (target_scale {target_scale}) and context blocks from "
                f"{smallest_context} (context_scale {context_scale}) cannot leave "
                f"min_context={min_context} context patches; lower target_scale or min_context."
            )

    def block(self, scale: float, aspect: float) -> tuple[int, int]:
        """(height, width) of a block of ``scale`` and ``aspect``, as the official collator
        rounds them (clamped to the grid)."""
        area = int(self.grid * self.grid * scale)
        h = int(round(math.sqrt(area * aspect)))
        w = int(round(math.sqrt(area / aspect)))
        return min(max(h, 1), self.grid), min(max(w, 1), self.grid)

    def block_sizes(self, step: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Target and context block sizes of ``step`` (a pure function of seed and step)."""
        rng = random.Random(f"{self.seed}:{step}")  # str seeds: deterministic in every process
        u = [rng.random() for _ in range(3)]
        (s0, s1), (a0, a1), (c0, c1) = self.target_scale, self.target_aspect, self.context_scale
        return self.block(s0 + u[0] * (s1 - s0), a0 + u[1] * (a1 - a0)), \
            self.block(c0 + u[2] * (c1 - c0), 1.0)

    def context_count(self, sizes: tuple[tuple[int, int], tuple[int, int]]) -> int:
        """Context patches kept per sample for these block sizes."""
        (th, tw), (ch, cw) = sizes
        return max(self.min_context, ch * cw - self.num_targets * th * tw)

    def _boxes(self, n: int, h: int, w: int, count: int, uniforms: Tensor | None) -> Tensor:
        """(n, count, grid²) bool masks of ``count`` random h×w blocks per sample, placed by
        ``uniforms`` (n, count, 2) when given, else by torch's RNG."""
        if uniforms is None:
            top = torch.randint(0, self.grid - h + 1, (n, count, 1, 1))
            left = torch.randint(0, self.grid - w + 1, (n, count, 1, 1))
        else:
            top = (uniforms[..., 0] * (self.grid - h + 1)).long().view(n, count, 1, 1)
            left = (uniforms[..., 1] * (self.grid - w + 1)).long().view(n, count, 1, 1)
        rows = torch.arange(self.grid).view(1, 1, -1, 1)
        cols = torch.arange(self.grid).view(1, 1, 1, -1)
        inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        return inside.flatten(2)

    def __call__(
        self, batch: int, step: int, world_size: int = 1, rank: int = 0,
        seeds: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(context, targets)``: (B, K) sorted context indices and (B, M, h·w) target indices
        (each target block in raster order) of this rank's samples, from their (B,) int64
        ``seeds`` when given."""
        sizes = self.block_sizes(step)
        (th, tw), (ch, cw) = sizes
        keep = self.context_count(sizes)
        if seeds is not None:
            seeds, world_size, rank = seeds.cpu(), 1, 0
        n = world_size * batch
        targets = torch.zeros(n, self.num_targets, self.grid ** 2, dtype=torch.bool)
        free = torch.zeros(n, self.grid ** 2, dtype=torch.bool)
        todo = torch.arange(n)
        m = self.num_targets
        for attempt in range(self.max_tries):
            u = None if seeds is None else keyed_uniform(
                derive(seeds[todo], attempt), 2 * m + 2).view(len(todo), m + 1, 2)
            boxes = self._boxes(len(todo), th, tw, m, None if u is None else u[:, :m])
            context = self._boxes(len(todo), ch, cw, 1, None if u is None else u[:, m:])[:, 0] \
                & ~boxes.any(dim=1)
            ok = context.sum(dim=1) >= keep
            targets[todo[ok]], free[todo[ok]] = boxes[ok], context[ok]
            todo = todo[~ok]
            if len(todo) == 0:
                break
        else:
            raise ValueError(
                f"No placement of {self.num_targets} target blocks {th}x{tw} leaves {keep} "
                f"patches of a {ch}x{cw} context block free on the {self.grid}x{self.grid} grid "
                f"in {self.max_tries} tries; lower min_context ({self.min_context}), "
                "num_targets or target_scale."
            )
        rows = slice(rank * batch, (rank + 1) * batch)
        # A random subset of `keep` free patches: free ones get noise in [0, 1), others 2.
        noise = (torch.rand(n, self.grid ** 2) if seeds is None else keyed_uniform(
            derive(seeds, self.max_tries), self.grid ** 2, torch.float32))
        noise = noise.masked_fill(~free, 2.0)[rows]
        context_idx = noise.argsort(dim=1)[:, :keep].sort(dim=1).values
        target_idx = targets[rows].nonzero()[:, 2].view(batch, self.num_targets, th * tw)
        return context_idx, target_idx
