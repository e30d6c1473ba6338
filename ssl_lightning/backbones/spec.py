"""What a checkpoint needs to rebuild its backbone: the class path and constructor arguments.

Every ssl_lightning backbone records its own arguments at construction
(:func:`remember_init_args`); for any other module the CLI records the ``class_path`` /
``init_args`` of the config. :func:`build_backbone` turns such a spec back into a module, so
evaluation, ``embed`` and ``export`` need only the checkpoint.

A checkpoint is data, so the class it names is imported and called only when it is on the
allow-list: the backbones of :mod:`ssl_lightning.backbones`, torchvision model classes and the
builders of ``torchvision.models.list_models()``, timm model classes and the builders of
``timm.list_models()``, every ``class_path`` of the config the CLI runs (:func:`trust_classes`),
and the entries of the :data:`TRUSTED_CLASSES_ENV` environment variable. A name given exactly is
admitted as it is; a ``package.*`` entry admits only the public ``nn.Module`` classes of the
package (and the built-in packages' model builders), decided before anything is called.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

#: Attribute of a backbone module holding its ``{"class_path": ..., "init_args": {...}}``.
SPEC_ATTRIBUTE = "backbone_spec"
#: Environment variable with more classes a checkpoint may name: comma-separated import paths
#: (``mypkg.nets.MyNet``) or whole packages (``mypkg.*``).
TRUSTED_CLASSES_ENV = "SSL_LIGHTNING_TRUSTED_CLASSES"
#: Packages whose model classes and builders a checkpoint may name (checked after import).
_BUILT_IN_PACKAGES = ("ssl_lightning.", "torchvision.models.", "timm.")
_trusted: set[str] = set()


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


def trust_classes(class_paths: Iterable[str]) -> None:
    """Let checkpoints name these classes too (import paths, or ``package.*`` for a package);
    the CLI passes every ``class_path`` of its config."""
    _trusted.update(path for path in class_paths if path)


def config_class_paths(config: Any) -> list[str]:
    """Every ``class_path`` value in a (nested) config: mappings, lists, jsonargparse
    namespaces."""
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    if isinstance(config, Mapping):
        found = [config["class_path"]] if isinstance(config.get("class_path"), str) else []
        return found + [p for value in config.values() for p in config_class_paths(value)]
    if isinstance(config, (list, tuple)):
        return [p for value in config for p in config_class_paths(value)]
    return []


def _trusted_by_user(class_path: str) -> str | None:
    """How the user trusts ``class_path``: ``"name"`` (named exactly, in the config or
    :data:`TRUSTED_CLASSES_ENV`), ``"package"`` (under a ``package.*`` entry) or None."""
    entries = (_trusted | set(re.split(r"[,\s]+", os.environ.get(TRUSTED_CLASSES_ENV, "")))) - {""}
    if class_path in entries:
        return "name"
    if any(entry.endswith(".*") and class_path.startswith(entry[:-1]) for entry in entries):
        return "package"
    return None


def _is_built_in_model(obj: Any) -> bool:
    """An ssl_lightning backbone class, or a torchvision / timm model class or builder."""
    module = str(getattr(obj, "__module__", ""))
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return module.startswith(("ssl_lightning.backbones.", "torchvision.models.", "timm."))
    name = getattr(obj, "__name__", "")
    if module.startswith("torchvision.models."):
        import torchvision

        return any(obj is torchvision.models.get_model_builder(n)
                   for n in torchvision.models.list_models())
    if module.startswith("timm."):
        import timm

        return bool(timm.is_model(name)) and timm.models.model_entrypoint(name) is obj
    return False


def _refused(class_path: str, source: str) -> ValueError:
    return ValueError(
        f"{source} names the backbone class {class_path!r}, which is not on the allow-list, so "
        "it is not called (a file could name any function). Allowed: "
        "ssl_lightning backbones, torchvision and timm models, the classes of the config. To "
        f"allow it, name it in the config or set {TRUSTED_CLASSES_ENV}={class_path} "
        "(comma-separated; 'package.*' allows a package), or pass the backbone explicitly "
        "(--model.backbone ...)."
    )


def _allowed_class(class_path: str, source: str) -> Any:
    """Import ``class_path`` if the allow-list admits it, before anything it names is called:
    checked by name before the import (public names of the built-in packages or of a trusted
    package, or a name the user trusts exactly), then by what the name resolves to (an
    ``nn.Module`` subclass or a model builder of the built-in packages; anything for a name the
    user trusts exactly, e.g. a builder function of theirs)."""
    trust = _trusted_by_user(class_path)
    private = any(part.startswith("_") for part in class_path.split("."))  # e.g. __main__
    if trust != "name" and (private or not (trust or class_path.startswith(_BUILT_IN_PACKAGES))):
        raise _refused(class_path, source)
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"{source} names the backbone class {class_path!r}, which cannot be imported "
            f"({err}); install the package that defines it, or pass the backbone explicitly "
            "(--model.backbone ...)."
        ) from err
    module_class = isinstance(cls, type) and issubclass(cls, nn.Module)
    if trust == "package" and not (module_class or _is_built_in_model(cls)):
        raise ValueError(
            f"{source} names {class_path!r}, a {type(cls).__name__} and not an nn.Module "
            f"class, so it is not called: a trusted package ({TRUSTED_CLASSES_ENV}='package.*')"
            " admits only its nn.Module classes. To allow this name, set "
            f"{TRUSTED_CLASSES_ENV}={class_path} (exactly), or pass the backbone explicitly "
            "(--model.backbone ...)."
        )
    if trust is None and not _is_built_in_model(cls):
        raise _refused(class_path, source)
    return cls


def build_backbone(spec: Mapping[str, Any], load_pretrained: bool = False,
                   source: str = "The backbone spec") -> nn.Module:
    """Instantiate the backbone a spec describes, if its class is on the allow-list (see the
    module docstring).

    Args:
        spec: ``{"class_path": "package.module.Class", "init_args": {...}}``.
        load_pretrained: Keep a recorded ``pretrained_path``; by default it is dropped, because
            the checkpoint's own weights replace it (and the file may not exist any more).
        source: Where the spec comes from, for the messages (e.g. ``"Checkpoint 'x.ckpt'"``).

    Raises:
        ValueError: The class is not allowed, cannot be imported or does not build an
            ``nn.Module``.
    """
    class_path = str(spec.get("class_path", ""))
    cls = _allowed_class(class_path, source)
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
