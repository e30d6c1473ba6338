"""MomentumMethod: the base of methods with an EMA (momentum) teacher — MoCo v2/v3, BYOL.

The method owns its teacher copies (built with :func:`momentum_teacher`, so they are frozen,
checkpointed and moved with the method), named ``teacher_<student module>`` (``teacher_backbone``,
``teacher_projector``, ``teacher_head``), and lists them in :meth:`ema_pairs`. It supplies its own
:class:`~ssl_lightning.callbacks.EMACallback` through ``configure_callbacks`` from its
``momentum_*`` arguments, so neither a Python user nor a config can forget the update. Lightning
lets a model's callbacks replace trainer callbacks of the same type: an ``EMACallback`` listed in
``trainer.callbacks`` is therefore overridden — set the schedule through the model's arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning._lightning import pl
from ssl_lightning.callbacks.ema import EMACallback
from ssl_lightning.compat.renamed import rename_state_keys_hook
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.training.ema import BufferPolicy, Schedule


class MomentumMethod(SSLMethod):
    """An :class:`SSLMethod` whose teacher is an exponential moving average of the student.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        momentum_base: EMA momentum tau at the first step.
        momentum_end: tau at the end of training (cosine schedule only).
        momentum_schedule: ``"cosine"`` (BYOL, MoCo v3) or ``"constant"`` (MoCo v2).
        ema_buffer_policy: How teacher buffers follow the student: ``"copy"``, ``"ema"`` or
            ``"none"`` (see :mod:`ssl_lightning.training.ema`).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        momentum_base: float = 0.996,
        momentum_end: float = 1.0,
        momentum_schedule: Schedule = "cosine",
        ema_buffer_policy: BufferPolicy = "copy",
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        # Built here so invalid values fail at construction, not at fit time.
        self.ema_callback = EMACallback(momentum_base, momentum_end, momentum_schedule,
                                        ema_buffer_policy)
        # Checkpoints that name the teachers key_* / target_* load into teacher_*.
        self.register_load_state_dict_pre_hook(rename_state_keys_hook)

    def configure_callbacks(self) -> list[pl.Callback]:
        """The EMA teacher update, configured from this method's ``momentum_*`` arguments."""
        return [self.ema_callback]

    def predict_both_views(self, views: Sequence[Tensor]
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The symmetric two-view forward of BYOL and MoCo v3: the student's predictions
        (predictor ∘ projector ∘ backbone) of views 0 and 1, the teacher's projections of both
        (no gradient), and view 0's backbone features."""
        self.require_views(views)
        features = self.backbone(views[0])
        p1 = self.predictor(self.projector(features))
        p2 = self.predictor(self.projector(self.backbone(views[1])))
        with torch.no_grad():
            z1 = self.teacher_projector(self.teacher_backbone(views[0]))
            z2 = self.teacher_projector(self.teacher_backbone(views[1]))
        return p1, p2, z1, z2, features
