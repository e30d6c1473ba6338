"""Checkpoints for evaluation: the loading functions of
:mod:`ssl_lightning.backbones.checkpoint` (the backbone of a pre-training checkpoint, with errors
that say what is wrong) and the ``checkpoint`` argument's rule (:func:`resolve_checkpoint`).
"""

from __future__ import annotations

import os

from ssl_lightning.backbones.checkpoint import (
    CHECKPOINT_FIX,
    DEFAULT_PREFIX,
    SPEC_KEY,
    backbone_from_checkpoint,
    backbone_state_dict,
    check_compatible,
    load_backbone,
    load_checkpoint,
    load_checkpoint_state_dict,
)

__all__ = ["CHECKPOINT_FIX", "DEFAULT_PREFIX", "RANDOM_INIT", "SPEC_KEY",
           "backbone_from_checkpoint", "backbone_state_dict", "check_compatible",
           "load_backbone", "load_checkpoint", "load_checkpoint_state_dict",
           "resolve_checkpoint"]

#: The ``checkpoint`` value that asks an evaluation module to keep the backbone as constructed.
RANDOM_INIT = "random"


def resolve_checkpoint(checkpoint: str | os.PathLike | None, owner: str) -> str | None:
    """The checkpoint path an evaluation module loads, or ``None`` for :data:`RANDOM_INIT`.

    A missing checkpoint would silently evaluate a randomly initialised backbone, so it must be
    asked for by name.

    Raises:
        ValueError: ``checkpoint`` is ``None`` or empty.
    """
    if checkpoint is None or os.fspath(checkpoint) == "":
        raise ValueError(
            f"{owner} got no checkpoint, so it would evaluate a randomly initialised backbone. "
            "Pass the pre-training checkpoint: --model.checkpoint runs/<name>/version_N/"
            f"checkpoints/last.ckpt (checkpoint=... in Python), or checkpoint: {RANDOM_INIT} to "
            "evaluate the backbone as constructed (the random-init baseline, or weights you "
            "loaded yourself)."
        )
    path = os.fspath(checkpoint)
    return None if path == RANDOM_INIT else path
