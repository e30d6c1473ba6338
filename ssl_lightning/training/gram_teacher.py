"""The Gram teacher of DINOv3's Gram anchoring: a frozen snapshot of the EMA teacher.

Siméoni et al., "DINOv3", arXiv 2508.10104, 2025, §4.2: the Gram teacher is an earlier
iteration of the EMA teacher, taken when the Gram stage starts and refreshed every ``K`` steps
(at most ``M`` times); it runs on higher-resolution crops (§4.3, ×2 in the paper) and its patch
features are resized with bicubic interpolation to the student's patch grid.

The snapshot is a module of the method (its weights are in the checkpoint) and
:attr:`GramTeacher.snapshot_step` records the optimiser step it was taken at, so a refresh is
idempotent (gradient accumulation calls it several times per step) and a run resumed at any step
continues with the same Gram teacher as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.training.ema import momentum_teacher


class GramTeacher(nn.Module):
    """Frozen copy of an EMA teacher backbone, refreshed on a step schedule.

    Snapshots are taken when the optimiser step count reaches ``start_step`` and then
    ``start_step + i·refresh_every`` for ``i = 1 … max_refreshes``.

    Args:
        teacher_backbone: The EMA teacher (a ViT with ``forward_tokens``) to snapshot.
        start_step: Optimiser step of the first snapshot (the Gram stage starts there).
        refresh_every: Steps between refreshes (DINOv3: 10,000); 0: never refreshed.
        max_refreshes: Most refreshes after the first snapshot (DINOv3: 3); None: no limit.
    """

    def __init__(self, teacher_backbone: nn.Module, start_step: int = 0, refresh_every: int = 0,
                 max_refreshes: int | None = None) -> None:
        super().__init__()
        for name, value in (("gram_start_step", start_step),
                            ("gram_refresh_every", refresh_every)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        if max_refreshes is not None and max_refreshes < 0:
            raise ValueError(f"gram_max_refreshes must be >= 0 or None, got {max_refreshes}.")
        self.backbone = momentum_teacher(teacher_backbone)
        self.start_step, self.refresh_every = start_step, refresh_every
        self.max_refreshes = max_refreshes
        self.register_buffer("snapshot_step", torch.tensor(-1, dtype=torch.long))

    def is_snapshot_step(self, step: int) -> bool:
        """Whether the schedule takes a snapshot when ``step`` optimiser steps are done."""
        if step == self.start_step:
            return True
        if step < self.start_step or self.refresh_every == 0:
            return False
        count, rest = divmod(step - self.start_step, self.refresh_every)
        return rest == 0 and (self.max_refreshes is None or count <= self.max_refreshes)

    @torch.no_grad()
    def refresh(self, step: int, ema_teacher: nn.Module) -> bool:
        """Copy ``ema_teacher``'s parameters and buffers when ``step`` is a snapshot step not
        taken yet; True when it copied."""
        if not self.is_snapshot_step(step) or int(self.snapshot_step) == step:
            return False
        for target, source in ((self.backbone.parameters(), ema_teacher.parameters()),
                               (self.backbone.buffers(), ema_teacher.buffers())):
            for t, s in zip(target, source, strict=True):
                t.copy_(s)
        self.snapshot_step.fill_(step)
        return True

    @torch.no_grad()
    def patch_features(self, crops: Tensor, grid: tuple[int, int]) -> Tensor:
        """Normalised patch tokens (B, h·w, D) of ``crops``, bicubically resized (no antialias,
        as the official code) to the student's ``grid`` (h, w) when the crops' grid differs.

        Runs through :meth:`forward`, so a sharded Gram teacher gathers its weights first."""
        if int(self.snapshot_step) < 0:
            raise ValueError("The Gram teacher has no snapshot yet: it is taken at "
                             f"gram_start_step={self.start_step}; the Gram loss starts there.")
        return cast(Tensor, self(crops, tuple(grid)))

    def forward(self, crops: Tensor, grid: tuple[int, int]) -> Tensor:
        """The patch features of :meth:`patch_features` (call that, which checks the
        snapshot)."""
        vit = cast(Any, self.backbone)
        patch = vit.patch_size
        tokens = vit.forward_tokens(crops)[:, vit.num_prefix_tokens:]
        own = (crops.shape[-2] // patch, crops.shape[-1] // patch)
        if own == tuple(grid):
            return tokens
        maps = tokens.transpose(1, 2).unflatten(2, own)
        resized = F.interpolate(maps, size=tuple(grid), mode="bicubic", align_corners=False)
        return resized.flatten(2).transpose(1, 2)
