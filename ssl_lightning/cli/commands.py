"""The map of ``python -m ssl_lightning`` subcommands (:data:`COMMANDS`: name -> usage, one-line
help, the function that runs it), which dispatch, ``--help`` and docs/cli.md's table read, and
the shipped configs (:data:`CONFIGS_DIR`). Each command's parser stays next to its code."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        name: The word after ``python -m ssl_lightning``.
        usage: Its arguments, as ``--help`` shows them.
        help: What it does, in one line.
        target: ``"module:function"`` called with the arguments after the name; None for
            LightningCLI's own subcommands (their flags are its dotted names, ``--model.lr``).
    """

    name: str
    usage: str
    help: str
    target: str | None = None


#: Every subcommand, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {command.name: command for command in (
    Command("fit", "--config NAME|FILE [--model.NAME VALUE ...]",
            "pre-train a method or train an evaluation (LightningCLI)"),
    Command("validate", "--config NAME|FILE --ckpt_path CKPT",
            "validate a checkpoint (LightningCLI)"),
    Command("test", "--config NAME|FILE --ckpt_path CKPT", "test a checkpoint (LightningCLI)"),
    Command("predict", "--config NAME|FILE --ckpt_path CKPT",
            "predict with a checkpoint (LightningCLI)"),
    Command("embed", "--checkpoint CKPT --images DIR --output FILE",
            "the embeddings of a folder of images", "ssl_lightning.evaluation.embed:main"),
    Command("export", "--checkpoint CKPT --output FILE [--format FORMAT]",
            "the backbone as a state dict, torchvision / timm weights, TorchScript or ONNX",
            "ssl_lightning.evaluation.export:main"),
    Command("list", "methods|backbones|configs [--filter TEXT]", "what a config can name",
            "ssl_lightning.cli.listing:main"),
    Command("channel-stats", "--images DIR [--output stats.yaml]",
            "per-channel mean and std of multi-channel images",
            "ssl_lightning.cli.channel_stats:main"),
    Command("consolidate", "SHARDED_DIR OUTPUT [--overwrite]",
            "one checkpoint file from a sharded checkpoint", "ssl_lightning.cli.consolidate:main"),
    Command("shard", "--images DIR --output DIR", "litdata shards for StreamingDataModule",
            "ssl_lightning.cli.shard:main"),
    Command("compare", "RUN_DIR... [--plot out.png]",
            "a table of finished runs and their curves", "ssl_lightning.cli.compare:main"),
    Command("replay", "CAPTURE_DIR [--precision 64-true] [--devices 1] [--dump-views DIR]",
            "run a diverged run's captured step again and report on it",
            "ssl_lightning.cli.replay:main"),
)}


def run_command(name: str, args: list[str]) -> Any:
    """Run the command ``name`` (one with a :attr:`Command.target`) on ``args``."""
    module, _, function = str(COMMANDS[name].target).partition(":")
    return getattr(importlib.import_module(module), function)(args)


#: ``name -> run(args)`` of the commands that are not LightningCLI subcommands.
EXTRA_COMMANDS: dict[str, Callable[[list[str]], Any]] = {
    name: partial(run_command, name) for name, command in COMMANDS.items() if command.target}

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"  # shipped with the package


def shipped_configs() -> list[Path]:
    """The configs shipped in :data:`CONFIGS_DIR` (``*.yaml``, sorted; ``shared/`` pieces are
    not among them)."""
    return sorted(CONFIGS_DIR.glob("*.yaml")) if CONFIGS_DIR.is_dir() else []


def shared_config_pieces() -> list[Path]:
    """The pieces in ``CONFIGS_DIR/shared`` composed after a method's config (``--config
    shared/fsdp``): the mappings; a list such as ``pretrain_callbacks.yaml`` is the value of one
    option (``trainer.callbacks``), not a config."""
    import yaml

    pieces = sorted((CONFIGS_DIR / "shared").glob("*.yaml"))
    return [p for p in pieces if isinstance(yaml.safe_load(p.read_text()), dict)]


def config_names() -> dict[str, Path]:
    """``--config`` name -> shipped file: ``simclr``, ..., and ``shared/<piece>``."""
    names = {p.stem: p for p in shipped_configs()}
    names.update({f"shared/{p.stem}": p for p in shared_config_pieces()})
    return names


def project_description() -> str:
    """The top of ``python -m ssl_lightning --help``: what this is, methods, configs, commands."""
    import ssl_lightning
    from ssl_lightning.methods import SSLMethod

    methods = sorted(name for name in ssl_lightning.__all__
                     if isinstance(getattr(ssl_lightning, name), type)
                     and issubclass(getattr(ssl_lightning, name), SSLMethod)
                     and name not in ("SSLMethod", "MomentumMethod"))
    configs = [p.name for p in shipped_configs()]
    return "\n".join([
        "ssl_lightning: self-supervised learning methods for images as PyTorch Lightning "
        "modules, exact under DDP.",
        f"Methods: {', '.join(methods)}.",
        f"Configs ({CONFIGS_DIR}): {', '.join(configs) or 'none found (installed package)'}.",
        "Commands: " + ", ".join(f"{c.name} (`{c.name} {c.usage}`: {c.help})"
                                 for c in COMMANDS.values()) + ".",
    ])
