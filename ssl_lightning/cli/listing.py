"""``python -m ssl_lightning list methods|backbones|configs [--filter TEXT]``: what can be named
in a config, without reading the source."""

from __future__ import annotations

import argparse
import fnmatch
from collections.abc import Iterable
from pathlib import Path

import yaml

from ssl_lightning.cli.commands import shared_config_pieces, shipped_configs

OUR_BACKBONES = {
    "ResNet": "ResNet-18/34/50/... with an optional CIFAR stem (--model.backbone ResNet "
              "--model.backbone.init_args.depth 50)",
    "SmallConvNet": "a few-layer ConvNet for tests and CPU runs",
    "ViT": "Vision Transformer with masking and registers (arch tiny/small/base)",
    "TorchvisionBackbone": "any torchvision classification model by name (below), classifier "
                           "removed",
    "TimmBackbone": "any timm model by name (below), classifier removed",
}


def method_rows() -> list[tuple[str, str]]:
    """Each registered method (:mod:`ssl_lightning.methods.registry`) by class name, with its
    display name, family, paper and shipped configs."""
    from ssl_lightning.methods.registry import method_entries

    rows = []
    for entry in sorted(method_entries(), key=lambda e: e.cls.__name__.lower()):
        configs = ", ".join(f"--config {Path(name).stem}" for name in entry.configs)
        rows.append((entry.cls.__name__,
                     f"{entry.title} ({entry.family}): {entry.paper} [{configs or 'no config'}]"))
    return rows


def config_models() -> Iterable[tuple[Path, str]]:
    for path in shipped_configs():
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        yield path, str(model.get("class_path", "")).rpartition(".")[2]


def first_comment(path: Path) -> str:
    lines = path.read_text().splitlines()
    return next((line.lstrip("# ").strip() for line in lines if line.startswith("#")), "")


def config_rows() -> list[tuple[str, str]]:
    rows = [(path.name, f"{model}: {first_comment(path)}") for path, model in config_models()]
    return rows + [(f"shared/{path.name}", f"piece: {first_comment(path)}")
                   for path in shared_config_pieces()]


def backbone_rows(pattern: str | None) -> list[tuple[str, str]]:
    import torchvision

    rows = [(name, text) for name, text in OUR_BACKBONES.items()]
    torchvision_names = torchvision.models.list_models(module=torchvision.models)
    rows += [(f"torchvision: {name}", "--model.backbone TorchvisionBackbone "
              f"--model.backbone.init_args.name {name}")
             for name in torchvision_names if matches(name, pattern)]
    try:
        import timm
    except ImportError:
        rows.append(("timm", "not installed: pip install 'ssl_lightning[timm]' lists its models"))
    else:
        rows += [(f"timm: {name}", f"--model.backbone TimmBackbone "
                  f"--model.backbone.init_args.name {name}")
                 for name in timm.list_models() if matches(name, pattern)]
    return [row for row in rows if matches(row[0], pattern) or row[0] in OUR_BACKBONES]


def matches(name: str, pattern: str | None) -> bool:
    """A substring, or a shell pattern when ``pattern`` holds ``*`` / ``?`` (case-insensitive)."""
    if not pattern:
        return True
    name, pattern = name.lower(), pattern.lower()
    if any(char in pattern for char in "*?["):
        return fnmatch.fnmatch(name.split(": ")[-1], pattern)
    return pattern in name


def main(args: list[str] | None = None) -> list[tuple[str, str]]:
    """Print the rows of one listing; returns them (for tests)."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning list",
        description="List what a config can name: methods (class_path of model), backbones "
                    "(ours, torchvision's and timm's models by name) and the shipped configs.")
    parser.add_argument("what", choices=("methods", "backbones", "configs"))
    parser.add_argument("--filter", default=None,
                        help="keep names containing TEXT (or matching a shell pattern: vit_*)")
    options = parser.parse_args(args)
    if options.what == "methods":
        rows = method_rows()
    elif options.what == "configs":
        rows = config_rows()
    else:
        rows = backbone_rows(options.filter)
    if options.what != "backbones":
        rows = [row for row in rows if matches(row[0], options.filter)]
    width = max((len(name) for name, _ in rows), default=0)
    for name, text in rows:
        print(f"{name:<{width}}  {text}")
    if not rows:
        print(f"nothing matches --filter {options.filter!r}")
    return rows
