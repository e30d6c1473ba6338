"""The preprocessing an evaluation tool uses for a checkpoint: its record
(:mod:`ssl_lightning.data.preprocessing`), overridden by flags, announced in one line."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ssl_lightning.backbones.checkpoint import load_checkpoint
from ssl_lightning.data.preprocessing import PREPROCESSING_KEY, describe, resolve_preprocessing


def recorded_preprocessing(path: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint's preprocessing record, or None when it has none (older checkpoints)."""
    record = load_checkpoint(path).get(PREPROCESSING_KEY)
    return dict(record) if isinstance(record, Mapping) else None


def checkpoint_preprocessing(path: str | os.PathLike, owner: str,
                             **overrides: Any) -> dict[str, Any]:
    """The settings ``owner`` (e.g. ``"embed"``) uses for the checkpoint at ``path``: its record
    with the ``overrides`` that are not None (warning where they differ from it), or a guess
    for a checkpoint without a record (with a warning); prints one line saying which."""
    record = recorded_preprocessing(path)
    settings = resolve_preprocessing(record, f"checkpoint {os.fspath(path)!r}", **overrides)
    given = any(v is not None for v in overrides.values())
    origin = ("guessed (the checkpoint has no record)" if record is None
              else "the checkpoint's, with overrides" if given else "the checkpoint's")
    print(f"{owner}: preprocessing {origin}: {describe(settings)}")
    return settings
