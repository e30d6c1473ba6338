"""Initialise a backbone from a local state-dict file (continued, domain-adaptive pre-training).

Accepted files: a torchvision or timm model's ``state_dict()`` (classifier weights are ignored),
a file written by ``python -m ssl_lightning export`` (formats ``state_dict``, ``torchvision``,
``timm``), or any ``{"state_dict": {...}}`` wrapper of those. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor, nn

#: Top-level names of classifier layers that a backbone drops; their weights are ignored.
CLASSIFIER_NAMES = ("fc", "classifier", "head", "heads")
#: Prefixes of wrapped modules (our backbones' ``net.``, a checkpoint's ``backbone.``, DDP's
#: ``module.``) stripped when every key of the file has one and the model has none.
WRAPPER_PREFIXES = ("net.", "backbone.", "module.")


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a state-dict file (``weights_only`` loading), unwrapped from
    ``{"state_dict": ...}`` / ``{"model": ...}`` containers."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained_path {path!r} does not exist.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"pretrained_path {path!r} is not a readable state-dict file "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})."
        ) from err
    for key in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"pretrained_path {path!r} does not hold a state dict of tensors.")
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


def load_pretrained(target: nn.Module, path: str | os.PathLike) -> None:
    """Load the weights at ``path`` into ``target`` strictly, but ignoring classifier weights.

    Raises:
        ValueError: Naming the first missing, unexpected or mis-shaped key.
    """
    state = read_state_dict(path)
    expected = target.state_dict()
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state) and not any(
            k.startswith(prefix) for k in expected
        ):
            state = {k[len(prefix):]: v for k, v in state.items()}
    state = {k: v for k, v in state.items()
             if k in expected or k.split(".", 1)[0] not in CLASSIFIER_NAMES}
    where = f"pretrained_path {os.fspath(path)!r} does not fit {type(target).__name__}"
    key, missing, unexpected = state_differences(expected, state)
    if key is not None:
        raise ValueError(
            f"{where}: {key!r} has shape {tuple(state[key].shape)} in the file and "
            f"{tuple(expected[key].shape)} in the model. Build the architecture the file "
            "was saved from."
        )
    if missing or unexpected:
        first = f"first missing key {missing[0]!r}" if missing else ""
        first += (", " if missing and unexpected else "")
        first += f"first unexpected key {unexpected[0]!r}" if unexpected else ""
        raise ValueError(
            f"{where}: {len(missing)} missing and {len(unexpected)} unexpected keys ({first}). "
            "Build the architecture the file was saved from."
        )
    target.load_state_dict(state)
