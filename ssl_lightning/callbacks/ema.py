"""Exponential moving average (momentum) teachers: the update rule, its schedule and a callback.

The momentum encoder of MoCo (He et al., "Momentum Contrast for Unsupervised Visual
Representation Learning", CVPR 2020, Eq. 2), the BYOL target network (Grill et al., "Bootstrap
Your Own Latent", NeurIPS 2020, §3.1) and the DINO teacher (Caron et al., ICCV 2021) all follow
``teacher = tau·teacher + (1 − tau)·student`` after every optimiser step. BYOL §3.2 introduced
the cosine schedule ``tau_k = 1 − (1 − tau_base)·(cos(π·k/K) + 1)/2`` that MoCo v3 and DINO
reuse.

The teacher lives in the method (so it is checkpointed and moved with it); the method names the
``(student, teacher)`` pairs in :meth:`SSLMethod.ema_pairs`. The callback is stateless: the step
``k`` is ``trainer.global_step`` and ``K`` is ``trainer.estimated_stepping_batches``, so a resumed
run continues the schedule exactly; after a resume with other steps per epoch, ``k`` is converted
through epochs as the lr's position is (:func:`ssl_lightning.optim.schedule_position`).

Buffers (BatchNorm running statistics and counters) follow ``buffer_policy``:
``"copy"`` (default) copies the student's buffers into the teacher after each update, so the
teacher evaluates with the student's statistics; ``"ema"`` averages floating-point buffers like
the parameters (integer buffers are copied); ``"none"`` leaves them to the teacher's own forward
passes (what the MoCo and BYOL reference code do, since they only average parameters).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import nn

from ssl_lightning.optim import schedule_position

Schedule = Literal["cosine", "constant"]
BufferPolicy = Literal["copy", "ema", "none"]


def momentum_teacher(student: nn.Module) -> nn.Module:
    """A deep copy of ``student`` with ``requires_grad=False`` on every parameter."""
    teacher = copy.deepcopy(student)
    teacher.requires_grad_(False)
    return teacher


def cosine_momentum(step: int, total_steps: int, base: float, end: float = 1.0) -> float:
    """``end − (end − base)·(cos(π·step/total_steps) + 1)/2``: ``base`` at step 0, ``end`` at
    ``total_steps`` (clamped beyond it)."""
    if total_steps <= 0:
        return base
    progress = min(max(step / total_steps, 0.0), 1.0)
    return end - (end - base) * (math.cos(math.pi * progress) + 1) / 2


@torch.no_grad()
def ema_update_(
    pairs: Sequence[tuple[nn.Module, nn.Module]], tau: float, buffer_policy: BufferPolicy = "copy"
) -> None:
    """In place: ``teacher = tau·teacher + (1 − tau)·student`` for every pair, with fused
    ``torch._foreach`` ops, then the buffers according to ``buffer_policy`` (see module doc)."""
    t_params: list[torch.Tensor] = []
    s_params: list[torch.Tensor] = []
    t_buffers: list[torch.Tensor] = []
    s_buffers: list[torch.Tensor] = []
    for student, teacher in pairs:
        for (name, s), (_, t) in zip(
            student.named_parameters(), teacher.named_parameters(), strict=True
        ):
            if s.shape != t.shape:
                raise ValueError(f"EMA pair mismatch at parameter {name!r}: student "
                                 f"{tuple(s.shape)} vs teacher {tuple(t.shape)}.")
            t_params.append(t)
            s_params.append(s.detach())
        for s_buf, t_buf in zip(student.buffers(), teacher.buffers(), strict=True):
            if buffer_policy == "ema" and t_buf.is_floating_point():
                t_buffers.append(t_buf)
                s_buffers.append(s_buf)
            elif buffer_policy != "none":
                t_buf.copy_(s_buf)
    for teachers, students in ((t_params, s_params), (t_buffers, s_buffers)):
        if teachers:
            torch._foreach_mul_(teachers, tau)
            torch._foreach_add_(teachers, students, alpha=1.0 - tau)


class EMACallback(pl.Callback):
    """Update the method's momentum teachers once per optimiser step.

    Under ``accumulate_grad_batches=k`` the update runs once per k micro-batches (whenever
    ``trainer.global_step`` has advanced), with ``tau`` of the optimiser step just taken: the
    first update uses ``tau_base``. Logs ``ema/tau``.

    Args:
        momentum_base: tau at step 0, in [0, 1] (0.996 BYOL, 0.99 MoCo v3, 0.999 MoCo v2).
        momentum_end: tau reached at the last step of the cosine schedule (1.0 in BYOL).
        schedule: ``"cosine"`` (BYOL §3.2) or ``"constant"`` (``momentum_base`` throughout,
            MoCo v1/v2).
        buffer_policy: ``"copy"``, ``"ema"`` or ``"none"`` (see the module docstring).
    """

    def __init__(
        self,
        momentum_base: float = 0.996,
        momentum_end: float = 1.0,
        schedule: Schedule = "cosine",
        buffer_policy: BufferPolicy = "copy",
    ) -> None:
        super().__init__()
        for name, value in (("momentum_base", momentum_base), ("momentum_end", momentum_end)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"EMACallback {name} must be in [0, 1], got {value}.")
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"EMACallback schedule must be 'cosine' or 'constant', got "
                             f"{schedule!r}.")
        if buffer_policy not in ("copy", "ema", "none"):
            raise ValueError(f"EMACallback buffer_policy must be 'copy', 'ema' or 'none', got "
                             f"{buffer_policy!r}.")
        self.momentum_base = momentum_base
        self.momentum_end = momentum_end
        self.schedule = schedule
        self.buffer_policy = buffer_policy
        self._last_step = 0

    def momentum(self, step: int, total_steps: int) -> float:
        """tau for the update that follows optimiser step ``step`` (0-based) of ``total_steps``."""
        if self.schedule == "constant":
            return self.momentum_base
        return cosine_momentum(step, total_steps, self.momentum_base, self.momentum_end)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pairs = self._pairs(pl_module)
        for _, teacher in pairs:
            if any(p.requires_grad for p in teacher.parameters()):
                raise ValueError(
                    f"EMA teacher {type(teacher).__name__} has parameters with requires_grad="
                    "True; build it with ssl_lightning.callbacks.ema.momentum_teacher()."
                )
        if self.schedule == "cosine" and not math.isfinite(trainer.estimated_stepping_batches):
            raise ValueError(
                "The cosine momentum schedule needs the total number of optimiser steps, but "
                "trainer.estimated_stepping_batches is infinite; set max_epochs or max_steps, or "
                "use schedule='constant'."
            )
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # no optimiser step on this micro-batch (gradient accumulation)
        self._last_step = trainer.global_step
        tau = self.momentum(*schedule_position(trainer, trainer.global_step - 1))
        ema_update_(self._pairs(pl_module), tau, self.buffer_policy)
        pl_module.log("ema/tau", tau, on_step=True, on_epoch=False)

    @staticmethod
    def _pairs(pl_module: pl.LightningModule) -> list[tuple[nn.Module, nn.Module]]:
        pairs = getattr(pl_module, "ema_pairs", None)
        result = pairs() if callable(pairs) else []
        if not result:
            raise ValueError(
                f"EMACallback needs a method whose ema_pairs() returns (student, teacher) "
                f"pairs; {type(pl_module).__name__}.ema_pairs() returned none."
            )
        return list(result)
