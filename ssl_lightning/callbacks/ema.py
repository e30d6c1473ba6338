"""The callback that updates exponential moving average (momentum) teachers.

The momentum encoder of MoCo (He et al., "Momentum Contrast for Unsupervised Visual
Representation Learning", CVPR 2020, Eq. 2), the BYOL target network (Grill et al., "Bootstrap
Your Own Latent", NeurIPS 2020, §3.1) and the DINO teacher (Caron et al., ICCV 2021) all follow
``teacher = tau·teacher + (1 − tau)·student`` after every optimiser step. BYOL §3.2 introduced
the cosine schedule ``tau_k = 1 − (1 − tau_base)·(cos(π·k/K) + 1)/2`` that MoCo v3 and DINO
reuse. The update rule and the teacher copy live in :mod:`ssl_lightning.training.ema`, the
schedule in :func:`ssl_lightning.optim.cosine_ramp`.

The teacher lives in the method (so it is checkpointed and moved with it); the method names the
``(student, teacher)`` pairs in :meth:`SSLMethod.ema_pairs`. The callback is stateless: the step
``k`` is ``trainer.global_step`` and ``K`` is ``trainer.estimated_stepping_batches``, so a resumed
run continues the schedule exactly; after a resume with other steps per epoch, ``k`` is converted
through epochs as the lr's position is (:func:`ssl_lightning.optim.schedule_position`).
Buffers follow ``buffer_policy`` (see :mod:`ssl_lightning.training.ema`).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ssl_lightning._lightning import pl
from ssl_lightning.optim import cosine_ramp, schedule_position
from ssl_lightning.training.ema import BufferPolicy, Schedule, ema_update_, momentum_teacher

cosine_momentum = cosine_ramp  # the former name of the ramp, kept for existing imports
__all__ = ["BufferPolicy", "EMACallback", "Schedule", "cosine_momentum", "ema_update_",
           "momentum_teacher"]

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
        buffer_policy: ``"copy"``, ``"ema"`` or ``"none"`` (see :mod:`ssl_lightning.training.ema`).
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
        return cosine_ramp(step, total_steps, self.momentum_base, self.momentum_end)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pairs = self._pairs(pl_module)
        for _, teacher in pairs:
            if any(p.requires_grad for p in teacher.parameters()):
                raise ValueError(
                    f"EMA teacher {type(teacher).__name__} has parameters with requires_grad="
                    "True; build it with ssl_lightning.training.ema.momentum_teacher()."
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
