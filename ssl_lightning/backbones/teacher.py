"""A frozen teacher backbone from any of its descriptions, and a fingerprint of its weights.

Used by :class:`~ssl_lightning.methods.Distillation`: the teacher is a module (with its weights,
e.g. from ``pretrained_path``), a ``{class_path, init_args}`` spec (built through the allow-list
of :mod:`ssl_lightning.backbones.spec`, its ``pretrained_path`` loaded) or one of our
checkpoints (:func:`~ssl_lightning.backbones.checkpoint.backbone_from_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.checkpoint import backbone_from_checkpoint
from ssl_lightning.backbones.spec import build_backbone


def frozen_teacher(teacher: nn.Module | None, checkpoint: str | None, prefix: str,
                   spec: Mapping[str, Any] | None) -> nn.Module:
    """The teacher given by exactly one of ``teacher``, ``checkpoint`` (read at ``prefix``) and
    ``spec``, in eval mode without gradients.

    Raises:
        ValueError: None or several of them are given, or the errors of loading it.
    """
    given = [n for n, v in (("teacher", teacher), ("teacher_checkpoint", checkpoint),
                            ("teacher_spec", spec)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            f"Distillation needs exactly one of teacher, teacher_checkpoint, teacher_spec; got "
            f"{given or 'none'}. E.g. --model.teacher_checkpoint runs/dino/version_0/"
            "checkpoints/last.ckpt, or teacher: {class_path: TimmBackbone, init_args: {name: "
            "..., pretrained_path: ...}}.")
    if checkpoint is not None:
        teacher = backbone_from_checkpoint(checkpoint, prefix=prefix,
                                           flag="--model.teacher_checkpoint_prefix")
    elif spec is not None:
        teacher = build_backbone(spec, load_pretrained=True, source="teacher_spec")
    assert teacher is not None
    return teacher.requires_grad_(False).eval()


def weight_fingerprint(weights: nn.Module | Mapping[str, Tensor]) -> Tensor:
    """Sum and sum of squares of every floating-point tensor of a module's state (or of a state
    dict, e.g. one gathered from shards), in float64 (K, 2): cheap to store, and any changed
    weight changes it."""
    state = weights.state_dict() if isinstance(weights, nn.Module) else weights
    values = [t.detach().double() for t in state.values() if t.is_floating_point()]
    return torch.stack([torch.stack([t.sum(), t.square().sum()]) for t in values]).cpu()
