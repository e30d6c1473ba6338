"""What a checkpoint needs to rebuild its backbone: the class path and constructor arguments.

Every ssl_lightning backbone records its own arguments at construction
(:func:`remember_init_args`); for any other module the CLI records the ``class_path`` /
``init_args`` of the config. :func:`build_backbone` turns such a spec back into a module, so
evaluation, ``embed`` and ``export`` need only the checkpoint.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

#: Attribute of a backbone module holding its ``{"class_path": ..., "init_args": {...}}``.
SPEC_ATTRIBUTE = "backbone_spec"


def remember_init_args(module: nn.Module, arguments: Mapping[str, Any]) -> None:
    """Store ``module``'s constructor arguments; call with ``locals()`` first in ``__init__``."""
    init_args = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
    kwargs = init_args.pop("kwargs", None) or {}
    cls = type(module)
    setattr(module, SPEC_ATTRIBUTE,
            {"class_path": f"{cls.__module__}.{cls.__qualname__}",
             "init_args": {**init_args, **kwargs}})


def backbone_spec(module: nn.Module) -> dict[str, Any] | None:
    """The recorded spec of ``module``, or ``None`` when it was not recorded."""
    spec = getattr(module, SPEC_ATTRIBUTE, None)
    return dict(spec) if isinstance(spec, Mapping) else None


def build_backbone(spec: Mapping[str, Any], load_pretrained: bool = False) -> nn.Module:
    """Instantiate the backbone a spec describes.

    Args:
        spec: ``{"class_path": "package.module.Class", "init_args": {...}}``.
        load_pretrained: Keep a recorded ``pretrained_path``; by default it is dropped, because
            the checkpoint's own weights replace it (and the file may not exist any more).

    Raises:
        ValueError: The class cannot be imported or does not build an ``nn.Module``.
    """
    class_path = str(spec.get("class_path", ""))
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"Cannot import the checkpoint's backbone class {class_path!r} ({err}); install the "
            "package that defines it, or pass the backbone explicitly (--model.backbone ...)."
        ) from err
    init_args = dict(spec.get("init_args") or {})
    if not load_pretrained:
        init_args.pop("pretrained_path", None)
    try:
        module = cls(**init_args)
    except TypeError as err:
        raise ValueError(
            f"Cannot build the backbone {class_path}(**{init_args}): {err}. Pass the backbone "
            "explicitly (--model.backbone ...)."
        ) from err
    if not isinstance(module, nn.Module):
        raise ValueError(f"{class_path!r} built a {type(module).__name__}, not an nn.Module.")
    return module
