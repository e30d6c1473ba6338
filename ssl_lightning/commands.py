"""The commands beside LightningCLI's (``embed``, ``export``, ``list``, ``channel-stats``,
``consolidate``, ``shard``, ``compare``, ``replay``) and the top-level help text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def _embed(args: list[str]) -> Any:
    from ssl_lightning.evaluation.embed import main

    return main(args)


def _export(args: list[str]) -> Any:
    from ssl_lightning.evaluation.export import main

    return main(args)


def _channel_stats(args: list[str]) -> Any:
    from ssl_lightning.data.channel_stats import main

    return main(args)


def _consolidate(args: list[str]) -> Any:
    from ssl_lightning.cli.consolidate import main

    return main(args)


def _shard(args: list[str]) -> Any:
    from ssl_lightning.data.shards import main

    return main(args)


def _compare(args: list[str]) -> Any:
    from ssl_lightning.cli.compare import main

    return main(args)


def _replay(args: list[str]) -> Any:
    from ssl_lightning.cli.replay import main

    return main(args)


def _list(args: list[str]) -> Any:
    from ssl_lightning.cli.listing import main

    return main(args)


#: ``python -m ssl_lightning <name> ...`` commands that are not LightningCLI subcommands.
EXTRA_COMMANDS: dict[str, Callable[[list[str]], Any]] = {
    "embed": _embed, "export": _export, "list": _list, "channel-stats": _channel_stats,
    "consolidate": _consolidate, "shard": _shard, "compare": _compare, "replay": _replay,
}

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # shipped with the package


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
        "Commands: fit/validate/test/predict (LightningCLI, e.g. `fit --config "
        "simclr`), embed (`embed --help`), export (`export --help`), "
        "list (`list methods|backbones|configs [--filter TEXT]`), channel-stats "
        "(`channel-stats --images DIR`: per-channel mean/std of multi-channel images), "
        "consolidate (`consolidate SHARDED_DIR OUTPUT [--overwrite]`: one file from a sharded "
        "checkpoint), shard "
        "(`shard --images DIR --output DIR`: litdata shards for StreamingDataModule), compare "
        "(`compare RUN_DIR... [--plot out.png]`: a table of finished runs and their curves), "
        "replay (`replay CAPTURE_DIR`: run a captured diverging step again and report on it).",
    ])
