"""Initialise a backbone from a local state-dict file (continued, domain-adaptive pre-training).

Accepted files: a torchvision or timm model's ``state_dict()`` (classifier weights are ignored),
released DINOv2 / DINOv3 ViT weights for our ViT (the official and timm layouts, recognised from
their keys: :mod:`ssl_lightning.backbones.released_weights`),
a file written by ``python -m ssl_lightning export`` (formats ``state_dict``, ``torchvision``,
``timm``), a ``.ckpt`` of an ssl_lightning method (its ``backbone.*`` weights, the student's; the
heads and a teacher are left out), or any ``{"state_dict": {...}}`` wrapper of those, saved with
``torch.save`` or as ``.safetensors``. Nothing is downloaded, and no file runs code: torch files
are read with ``torch.load(weights_only=True)`` (:func:`load_torch_data`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor, nn

from ssl_lightning._lightning import rank_zero_info
from ssl_lightning.backbones.released_weights import OWN_KEYS, argument_hint, to_vit_layout
from ssl_lightning.io.torch_files import load_torch_data

#: Top-level names of classifier layers that a backbone drops; their weights are ignored.
CLASSIFIER_NAMES = ("fc", "classifier", "head", "heads")
#: Prefixes of wrapped modules (our backbones' ``net.``, a checkpoint's ``backbone.``, DDP's
#: ``module.``) stripped when every key of the file has one and the model has none.
WRAPPER_PREFIXES = ("net.", "backbone.", "module.")
#: The prefix of a method checkpoint's (student) backbone, beside its heads and teacher.
METHOD_BACKBONE_PREFIX = "backbone."


#: The fix named when a ``pretrained_path`` cannot be read.
_PRETRAINED_FIX = ("Pass a state-dict file saved with torch.save (.pt, .pth) or as .safetensors, "
                   "e.g. one written by `python -m ssl_lightning export`.")


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a state-dict file (``torch.save`` with ``weights_only`` loading, or
    ``.safetensors``), unwrapped from ``{"state_dict": ...}`` / ``{"model": ...}`` containers;
    a file with a NaN or infinite value is refused, naming its first such tensor."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained_path {path!r} does not exist.")
    state: Any
    if path.endswith(".safetensors"):
        try:
            state = safetensors.torch.load_file(path, device="cpu")
        except safetensors.SafetensorError as err:
            raise ValueError(
                f"pretrained_path {path!r} cannot be read ({os.path.getsize(path)} bytes): not "
                f"a complete safetensors file ({err}). {_PRETRAINED_FIX}"
            ) from err
    else:
        state = load_torch_data(path, "pretrained_path", _PRETRAINED_FIX)
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"pretrained_path {path!r} does not hold a state dict of tensors.")
    bad = next((key for key, value in state.items()
                if (value.is_floating_point() or value.is_complex())
                and not bool(torch.isfinite(value).all())), None)
    if bad is not None:
        values = state[bad]
        raise ValueError(
            f"pretrained_path {path!r} holds NaN or infinite values: tensor {bad!r} has "
            f"{int((~torch.isfinite(values)).sum())} of {values.numel()} (the first such "
            "tensor). The weights come from a run that diverged, or the file is damaged: use "
            "a checkpoint from before the divergence.")
    return dict(state)


def state_differences(
    expected: Mapping[str, Tensor], state: Mapping[str, Tensor]
) -> tuple[str | None, list[str], list[str]]:
    """How ``state`` departs from a module's ``expected`` state dict: the first key present in
    both with another shape (None if none), then the missing keys and the unexpected keys."""
    reshaped = next((k for k, v in state.items()
                     if k in expected and expected[k].shape != v.shape), None)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    return reshaped, missing, unexpected


def load_pretrained(target: nn.Module, path: str | os.PathLike) -> str:
    """Load the weights at ``path`` into ``target`` strictly, but ignoring classifier weights.

    Returns:
        The line it also logs (rank 0): tensors loaded, the layout detected, a wrapper prefix
        removed, classifier tensors ignored, and no missing or unexpected key.

    Raises:
        ValueError: Naming the first missing, unexpected or mis-shaped key.
    """
    state = read_state_dict(path)
    expected = target.state_dict()
    others = method_checkpoint_others(state, expected)
    if others:
        state = {k: v for k, v in state.items() if k.startswith(METHOD_BACKBONE_PREFIX)}
    stripped = ""
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state) and not any(
            k.startswith(prefix) for k in expected
        ):
            state = {k[len(prefix):]: v for k, v in state.items()}
            stripped += prefix
    where = f"pretrained_path {os.fspath(path)!r} does not fit {type(target).__name__}"
    origin: dict[str, str] = {}
    layout = "the model's own"
    if any(k in expected for k in OWN_KEYS):  # our ViT: released DINOv2 / DINOv3 layouts
        try:
            state, layout, origin = to_vit_layout(state, target)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        if layout not in ("ours", "unknown"):
            where += f" (the file has the {layout} layout)"
        layout = {"ours": "the model's own", "unknown": "the model's own"}.get(layout, layout)
    ignored = [k for k in state
               if k not in expected and k.split(".", 1)[0] in CLASSIFIER_NAMES]
    state = {k: v for k, v in state.items() if k not in ignored}
    key, missing, unexpected = state_differences(expected, state)
    if key is not None:
        raise ValueError(
            f"{where}: {_named(key, origin)} has shape {tuple(state[key].shape)} in the file "
            f"and {tuple(expected[key].shape)} in the model. {_fix(key)}"
        )
    if missing or unexpected:
        first = f"first missing key {missing[0]!r}" if missing else ""
        first += (", " if missing and unexpected else "")
        first += f"first unexpected key {_named(unexpected[0], origin)}" if unexpected else ""
        raise ValueError(
            f"{where}: {len(missing)} missing and {len(unexpected)} unexpected keys ({first}). "
            f"{_fix((missing or unexpected)[0])}"
        )
    target.load_state_dict(state)
    count = sum(v.numel() for v in state.values())
    values = f"{count / 1e6:.2f}M" if count >= 10_000 else str(count)
    line = (f"pretrained_path {os.fspath(path)!r}: loaded {len(state)} tensors "
            f"({values} values) into {type(target).__name__}, {layout} layout"
            + (f", prefix {stripped!r} removed" if stripped else "")
            + (f", {len(others)} tensors of the method's heads and teacher left out "
               f"({', '.join(others[:2])}" + (", ..." if len(others) > 2 else "") + ")"
               if others else "")
            + (f", {len(ignored)} classifier tensors ignored ({', '.join(ignored[:4])}"
               + (", ..." if len(ignored) > 4 else "") + ")" if ignored else "")
            + "; 0 missing and 0 unexpected keys")
    rank_zero_info(line)
    return line


def method_checkpoint_others(state: Mapping[str, Tensor], expected: Mapping[str, Tensor]
                             ) -> list[str]:
    """The keys besides ``backbone.*`` when ``state`` is a method checkpoint's (``backbone.*``
    weights beside heads or a teacher, for a model without a ``backbone`` module), else ``[]``."""
    if any(k.startswith(METHOD_BACKBONE_PREFIX) for k in expected) or not any(
            k.startswith(METHOD_BACKBONE_PREFIX) for k in state):
        return []
    return [k for k in state if not k.startswith(METHOD_BACKBONE_PREFIX)]


def _named(key: str, origin: Mapping[str, str]) -> str:
    """``'key'``, with the file's own name when the key was renamed from it."""
    return f"{key!r} (the file's {origin[key]!r})" if key in origin else repr(key)


def _fix(key: str) -> str:
    hint = argument_hint(key)
    return ("Build the architecture the file was saved from"
            + (f" (ViT argument: {hint})." if hint else "."))
