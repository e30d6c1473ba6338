"""Exponential moving average (momentum) teachers: the teacher copy and the update rule.

``teacher = tau·teacher + (1 − tau)·student`` after every optimiser step: the momentum encoder of
MoCo (He et al., CVPR 2020, Eq. 2), the BYOL target network (Grill et al., NeurIPS 2020, §3.1)
and the DINO teacher (Caron et al., ICCV 2021). Methods build their teachers with
:func:`momentum_teacher`; :class:`~ssl_lightning.callbacks.EMACallback` applies
:func:`ema_update_` with the momentum of the step.

Buffers (BatchNorm running statistics and counters) follow ``buffer_policy``:
``"copy"`` (default) copies the student's buffers into the teacher after each update, so the
teacher evaluates with the student's statistics; ``"ema"`` averages floating-point buffers like
the parameters (integer buffers are copied); ``"none"`` leaves them to the teacher's own forward
passes (what the MoCo and BYOL reference code do, since they only average parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from ssl_lightning.distributed.sharding import layout_name, local_tensor, same_layout

Schedule = Literal["cosine", "constant"]
BufferPolicy = Literal["copy", "ema", "none"]


def momentum_teacher(student: nn.Module) -> nn.Module:
    """A deep copy of ``student`` with ``requires_grad=False`` on every parameter."""
    teacher = copy.deepcopy(student)
    teacher.requires_grad_(False)
    return teacher


@torch.no_grad()
def ema_update_(
    pairs: Sequence[tuple[nn.Module, nn.Module]], tau: float, buffer_policy: BufferPolicy = "copy"
) -> None:
    """In place: ``teacher = tau·teacher + (1 − tau)·student`` for every pair, with fused
    ``torch._foreach`` ops, then the buffers according to ``buffer_policy`` (see the module doc).
    Sharded pairs (FSDP2) update their local shards, which must be laid out alike."""
    t_params: list[torch.Tensor] = []
    s_params: list[torch.Tensor] = []
    t_buffers: list[torch.Tensor] = []
    s_buffers: list[torch.Tensor] = []
    for student, teacher in pairs:
        for (name, s), (_, t) in zip(
            student.named_parameters(), teacher.named_parameters(), strict=True
        ):
            if s.shape != t.shape or not same_layout(s, t):
                raise ValueError(f"EMA pair mismatch at parameter {name!r}: student "
                                 f"{tuple(s.shape)} ({layout_name(s)}) vs teacher "
                                 f"{tuple(t.shape)} ({layout_name(t)}).")
            t_params.append(local_tensor(t))
            s_params.append(local_tensor(s.detach()))
        for s_buf, t_buf in zip(student.buffers(), teacher.buffers(), strict=True):
            s_buf, t_buf = local_tensor(s_buf), local_tensor(t_buf)
            if buffer_policy == "ema" and t_buf.is_floating_point():
                t_buffers.append(t_buf)
                s_buffers.append(s_buf)
            elif buffer_policy != "none":
                t_buf.copy_(s_buf)
    for teachers, students in ((t_params, s_params), (t_buffers, s_buffers)):
        if teachers:
            torch._foreach_mul_(teachers, tau)
            torch._foreach_add_(teachers, students, alpha=1.0 - tau)
