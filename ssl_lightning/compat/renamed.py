"""Renamed arguments and state-dict prefixes, accepted under their old names for one release.

A method declares its renamed constructor arguments in ``renamed_arguments`` (old name -> new
name) and keeps each old name as a keyword-only parameter defaulting to ``None``, so Python
callers and configs read by LightningCLI (which validates against the signature) can still use
it; :func:`renamed_argument` maps the old value onto the new parameter with a ``FutureWarning``
naming the new one; :func:`rename_hyperparameters` saves the value under the new name only, so
checkpoints record only the new names.

Teacher copies of every momentum method are ``teacher_*`` modules; checkpoints written with the
older ``key_*`` (MoCo) and ``target_*`` (BYOL, I-JEPA) names still load:
:func:`rename_state_keys` maps their keys, and :func:`renamed_prefix` maps a backbone prefix
such as ``key_backbone.`` given to an evaluation or export command.
"""

from __future__ import annotations

import inspect
from collections.abc import MutableMapping
from typing import Any, TypeVar

from torch import nn

from ssl_lightning._lightning import rank_zero_warn

T = TypeVar("T")

#: Old -> new top-level module names of the momentum teachers in a method's state dict.
RENAMED_STATE_PREFIXES: dict[str, str] = {
    "key_backbone.": "teacher_backbone.",
    "key_projector.": "teacher_projector.",
    "target_backbone.": "teacher_backbone.",
    "target_projector.": "teacher_projector.",
}


def rename_hyperparameters(hparams: MutableMapping[str, Any], cls: type) -> None:
    """Move, in place, every value saved under an old argument name of ``cls`` (the
    ``renamed_arguments`` along its MRO) to the new name; drop the old names.

    Needed besides :func:`renamed_argument` because LightningCLI saves the hyperparameters as
    its config gave them, under the names the config used.
    """
    for klass in cls.__mro__:
        for old, new in vars(klass).get("renamed_arguments", {}).items():
            value = hparams.pop(old, None)
            if value is not None:
                hparams[new] = value


def renamed_argument(owner: object, old: str, old_value: T | None, new_value: T) -> T:
    """The value of a renamed argument: ``new_value``, or ``old_value`` when the caller used the
    old name (with a ``FutureWarning`` naming the new one).

    Args:
        owner: The object being constructed; the class along its MRO that lists ``old`` in its
            ``renamed_arguments`` gives the new name and its default.
        old: The deprecated argument name.
        old_value: What the caller passed under ``old`` (``None``: not used).
        new_value: What the caller passed under the new name (or its default).

    Raises:
        ValueError: Both names were given (the new one with a value other than its default).
    """
    cls = next(k for k in type(owner).__mro__ if old in vars(k).get("renamed_arguments", {}))
    new = vars(cls)["renamed_arguments"][old]
    if old_value is None:
        return new_value
    name = type(owner).__name__
    if new_value != inspect.signature(vars(cls)["__init__"]).parameters[new].default:
        raise ValueError(f"{name} got both {old}={old_value!r} and {new}={new_value!r}; {old} is "
                         f"the deprecated name of {new}: pass only {new}.")
    rank_zero_warn(f"{name}: the argument {old} is deprecated and will be removed in the next "
                   f"release; use {new} instead.", category=FutureWarning)
    return old_value


def renamed_prefix(prefix: str) -> str:
    """``prefix`` with an old teacher module name replaced by the new one (a ``FutureWarning``
    says so); other prefixes unchanged."""
    for old, new in RENAMED_STATE_PREFIXES.items():
        if prefix.startswith(old):
            rank_zero_warn(f"The checkpoint prefix {prefix!r} is deprecated and will be removed "
                           f"in the next release; use {new + prefix[len(old):]!r} instead.",
                           category=FutureWarning)
            return new + prefix[len(old):]
    return prefix


def rename_state_keys(
    state: MutableMapping[str, Any], module: nn.Module | None = None, prefix: str = ""
) -> None:
    """Rename, in place, the keys of ``state`` under ``prefix`` + an old teacher prefix (see
    :data:`RENAMED_STATE_PREFIXES`) to the new prefix; the module metadata ``state._metadata``
    (BatchNorm versions) follows. An old prefix that names a child of ``module`` is kept.
    """
    metadata = getattr(state, "_metadata", None)
    children = set(module._modules) if module is not None else set()
    for old, new in RENAMED_STATE_PREFIXES.items():
        if old[:-1] in children:
            continue
        source, target = prefix + old, prefix + new
        for key in [k for k in state if k.startswith(source)]:
            state[target + key[len(source):]] = state.pop(key)
        if metadata is not None:
            for key in [k for k in metadata if (k + ".").startswith(source)]:
                metadata[target[:-1] + key[len(source) - 1:]] = metadata.pop(key)


def rename_state_keys_hook(module: nn.Module, state: MutableMapping[str, Any], prefix: str,
                           *args: Any) -> None:
    """:func:`rename_state_keys` as a ``module.register_load_state_dict_pre_hook`` hook."""
    rename_state_keys(state, module, prefix)
