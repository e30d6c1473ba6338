"""``Method.load_from_checkpoint(path)`` without arguments: the backbone of a checkpoint rebuilt
from its recorded ``backbone_spec`` (:mod:`ssl_lightning.backbones.spec`, under the same class
allow-list as evaluation, ``embed`` and ``export``), and a sharded checkpoint directory read
whole (:func:`ssl_lightning.distributed.sharding.load_sharded_checkpoint`)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import IO, Any

import torch
from torch import nn

from ssl_lightning.backbones.checkpoint import SPEC_KEY, load_checkpoint
from ssl_lightning.backbones.spec import build_backbone
from ssl_lightning.distributed.sharding import is_sharded_checkpoint


def recorded_backbone(path: str | os.PathLike, method: str) -> nn.Module:
    """A fresh backbone of the class and arguments the checkpoint at ``path`` records (its
    weights come with the method's state dict).

    Raises:
        ValueError: The checkpoint records no spec (written from Python with a backbone of
            one's own), or names a class outside the allow-list.
    """
    spec = load_checkpoint(path).get(SPEC_KEY)
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"Checkpoint {os.fspath(path)!r} does not record its backbone class, so "
            f"{method}.load_from_checkpoint cannot rebuild it: pass it, "
            f"{method}.load_from_checkpoint(path, backbone=<the module it was trained with>).")
    return build_backbone(spec, source=f"Checkpoint {os.fspath(path)!r}")


def checkpoint_source(path: Any) -> Any:
    """What Lightning's ``load_from_checkpoint`` reads for ``path``: the path itself, or for a
    sharded checkpoint directory its consolidated dict as an in-memory file."""
    if not isinstance(path, (str, os.PathLike)) or not is_sharded_checkpoint(path):
        return path
    buffer: IO[bytes] = io.BytesIO()
    torch.save(dict(load_checkpoint(path)), buffer)
    buffer.seek(0)
    return buffer
