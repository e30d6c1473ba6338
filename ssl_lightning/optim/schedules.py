"""Per-step schedules: warm-up + cosine lr (Goyal et al., 2017; Loshchilov & Hutter, 2017) that
resumes with the schedule of the new run (see docs/cli.md), the cosine ramp of the other
per-step schedules (EMA momentum, weight decay) and the position they share.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    import pytorch_lightning as pl


class WarmupCosine:
    """LR multiplier: linear warm-up from 0 over ``warmup_steps``, then cosine to ``final_ratio``.

    A picklable callable for ``torch.optim.lr_scheduler.LambdaLR``; the schedule is a pure
    function of the step, so the scheduler's ``last_epoch`` is all that resuming needs.
    """

    def __init__(self, warmup_steps: int, total_steps: int, final_ratio: float = 0.0) -> None:
        if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
            raise ValueError(
                f"Need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}), "
                "total_steps >= 1."
            )
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.final_ratio = final_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosineLR(LRScheduler):
    """Per-optimiser-step :class:`WarmupCosine` whose checkpoint restores the position only.

    Resuming continues with the schedule *of the new run*: its total steps, warm-up, peak lr
    (scaled for its global batch) and the optimiser hyperparameters it configured (weight decay,
    momentum, ...), while the step count and the optimiser's per-parameter state (momentum
    buffers) come from the checkpoint. Lightning loads the optimiser state first (which brings
    back the old groups' values) and this scheduler second, so :meth:`load_state_dict` puts the
    configured values back. When nothing changed this is exactly the stored state.

    When the steps per epoch changed (batch size, device count) and the run is bounded by
    ``max_epochs``, the position is converted through epochs (``step_shift``), so the new
    schedule ends with the last epoch instead of before it. A run bounded by ``max_steps`` keeps
    ``global_step`` as its position.

    Args:
        optimizer: The optimiser (its groups' ``lr`` are the peak values).
        warmup_steps, total_steps, final_ratio: See :class:`WarmupCosine`.
        fixed_groups: Per group, True to keep the peak lr throughout (no warm-up, no cosine).
        steps_per_epoch: Optimiser steps per epoch of this run.
        global_batch_size: This run's global batch (for the resume message), None if unknown.
        epoch_based: True when ``max_epochs`` bounds the run (see above).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        final_ratio: float = 0.0,
        fixed_groups: Sequence[bool] | None = None,
        steps_per_epoch: int = 1,
        global_batch_size: int | None = None,
        epoch_based: bool = True,
    ) -> None:
        self.schedule = WarmupCosine(warmup_steps, total_steps, final_ratio)
        self.fixed_groups = list(fixed_groups or [False] * len(optimizer.param_groups))
        self.steps_per_epoch, self.global_batch_size = steps_per_epoch, global_batch_size
        self.epoch_based, self.step_shift = epoch_based, 0
        self.optimizer_class = type(optimizer).__name__
        self._configured = [{k: v for k, v in g.items() if k not in ("params", "lr")}
                            for g in optimizer.param_groups]
        super().__init__(optimizer)

    def get_lr(self) -> list[float | Tensor]:
        factor = self.schedule(self.last_epoch + self.step_shift)
        return [base if fixed else base * factor
                for base, fixed in zip(self.base_lrs, self.fixed_groups, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (loadable with ``torch.load(weights_only=True)``)."""
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("optimizer", "schedule", "_configured")}
        state["schedule"] = dict(vars(self.schedule))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the step count from ``state_dict``, keep this run's schedule (warn if it
        differs)."""
        old = _StoredSchedule.read(state_dict)
        if old.optimizer_class not in (None, self.optimizer_class):
            raise ValueError(
                f"The checkpoint's optimiser state is of {old.optimizer_class}, this run uses "
                f"{self.optimizer_class}: resuming needs the same optimizer (set it back to the "
                "checkpoint's, or start a new run)."
            )
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        self.step_shift = old.step_shift if self.epoch_based else 0
        if self.epoch_based and old.steps_per_epoch not in (None, self.steps_per_epoch):
            epochs_done = (self.last_epoch + old.step_shift) / old.steps_per_epoch
            self.step_shift = round(epochs_done * self.steps_per_epoch) - self.last_epoch
        for group, configured in zip(self.optimizer.param_groups, self._configured, strict=True):
            group.update(configured)
        values = self.get_lr()
        for group, lr, base in zip(self.optimizer.param_groups, values, self.base_lrs, strict=True):
            group["lr"], group["initial_lr"] = lr, base
        self._last_lr = values
        changes = old.changes(self)
        if changes:
            warnings.warn(
                f"Resuming at step {self.last_epoch} with a changed schedule: "
                f"{'; '.join(changes)}. The new run's schedule is used: lr {values[0]:.6g} now "
                f"(step {self.last_epoch + self.step_shift} of {self.schedule.total_steps}).",
                UserWarning, stacklevel=2,
            )


def run_schedule(trainer: pl.Trainer, optimizer: Optimizer, warmup_epochs: float,
                 final_ratio: float = 0.0, global_batch_size: int | None = None
                 ) -> WarmupCosineLR:
    """The per-step :class:`WarmupCosineLR` of a run on ``trainer``: total steps from
    ``estimated_stepping_batches``, warm-up and steps per epoch from the train loader's length
    (after gradient accumulation). Groups marked ``fixed_lr`` keep their peak lr.

    Raises:
        ValueError: ``warmup_epochs > 0`` with a train loader without a length.
    """
    total_steps = int(trainer.estimated_stepping_batches)
    batches = trainer.num_training_batches
    if not math.isfinite(batches) and warmup_epochs > 0:
        raise ValueError(
            f"warmup_epochs={warmup_epochs} needs a train dataloader with a length; "
            "set warmup_epochs: 0 for an iterable dataset."
        )
    steps_per_epoch = (max(1, math.ceil(batches / trainer.accumulate_grad_batches))
                       if math.isfinite(batches) else 1)
    return WarmupCosineLR(
        optimizer, min(total_steps, round(warmup_epochs * steps_per_epoch)), total_steps,
        final_ratio, fixed_groups=[bool(g.get("fixed_lr")) for g in optimizer.param_groups],
        steps_per_epoch=steps_per_epoch, global_batch_size=global_batch_size,
        epoch_based=trainer.max_steps == -1 or total_steps < trainer.max_steps,
    )


def cosine_ramp(step: int, total_steps: int, base: float, end: float = 1.0) -> float:
    """``end − (end − base)·(cos(π·step/total_steps) + 1)/2``: ``base`` at step 0, ``end`` at
    ``total_steps`` (clamped beyond it). The EMA momentum (BYOL §3.2) and the weight decay
    (DINO) follow it."""
    if total_steps <= 0:
        return base
    progress = min(max(step / total_steps, 0.0), 1.0)
    return end - (end - base) * (math.cos(math.pi * progress) + 1) / 2


def epoch_linspace(epoch: int, warmup_epochs: int, start: float, end: float) -> float:
    """The value of ``epoch`` in ``linspace(start, end, warmup_epochs)`` followed by ``end``:
    ``start`` at epoch 0, ``end`` from epoch ``warmup_epochs − 1`` on (the teacher-temperature
    warm-up of the official DINO / iBOT / DINOv2 code, ``np.linspace`` per epoch; 3 epochs
    give 0.04, 0.055, 0.07)."""
    if epoch >= warmup_epochs:
        return end
    if warmup_epochs == 1:
        return start
    return start + (end - start) * epoch / (warmup_epochs - 1)


def schedule_position(trainer: pl.Trainer, step: int) -> tuple[int, int]:
    """``(position, total steps)`` of optimiser step ``step`` in this run's per-step schedules.

    ``(step, estimated_stepping_batches)``, unless the lr scheduler is a resumed
    :class:`WarmupCosineLR` that converted its position through epochs (``step_shift``: the
    steps per epoch changed in a ``max_epochs``-bounded run). The other per-step schedules (EMA
    momentum, weight decay) then take the same position, so every schedule ends with the last
    epoch and stays consistent with the lr.
    """
    for config in trainer.lr_scheduler_configs:
        if isinstance(config.scheduler, WarmupCosineLR):
            return step + config.scheduler.step_shift, config.scheduler.schedule.total_steps
    return step, int(trainer.estimated_stepping_batches)


@dataclass
class _StoredSchedule:
    """The schedule a checkpoint was written with (also from a plain ``LambdaLR`` state)."""

    warmup_steps: int
    total_steps: int
    base_lrs: list[float]
    steps_per_epoch: int | None
    global_batch_size: int | None
    step_shift: int
    optimizer_class: str | None

    @classmethod
    def read(cls, state: dict[str, Any]) -> _StoredSchedule:
        schedule = state.get("schedule") or (state.get("lr_lambdas") or [{}])[0]
        return cls(schedule.get("warmup_steps", -1), schedule.get("total_steps", -1),
                   list(state["base_lrs"]), state.get("steps_per_epoch"),
                   state.get("global_batch_size"), state.get("step_shift", 0),
                   state.get("optimizer_class"))

    def changes(self, new: WarmupCosineLR) -> list[str]:
        """``"name old -> new"`` for every schedule quantity that differs from ``new``'s."""
        pairs: list[tuple[str, object, object]] = [
            ("total steps", self.total_steps, new.schedule.total_steps),
            ("warm-up steps", self.warmup_steps, new.schedule.warmup_steps),
            ("steps per epoch", self.steps_per_epoch, new.steps_per_epoch),
            ("global batch", self.global_batch_size, new.global_batch_size),
        ]
        if self.base_lrs != list(new.base_lrs):
            pairs.append(("peak lr", f"{self.base_lrs[0]:.6g}", f"{float(new.base_lrs[0]):.6g}"))
        return [f"{name} {before} -> {after}" for name, before, after in pairs
                if before not in (None, -1) and before != after]
