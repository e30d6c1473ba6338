"""LightningCLI wiring: ``python -m ssl_lightning fit --config configs/simclr.yaml``.

Model and data module are chosen in subclass mode, so a config names any ``LightningModule``
(every :class:`~ssl_lightning.methods.SSLMethod`, and the linear-evaluation module, which is not
one) and any ``LightningDataModule`` by ``class_path``; the public classes of ``ssl_lightning``
can be named without their module (``class_path: SimCLR``). ``--help``, ``--print_config`` and
overrides such as ``--model.temperature 0.2`` are LightningCLI's. Errors are printed as
``error: <message>`` with a non-zero exit code, and ``--ckpt_path`` resumes the run the config
describes (see ``docs/cli.md``). ``--config simclr`` names a shipped config from any directory.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any

from ssl_lightning._lightning import NAMESPACE, NAMESPACE_VARIABLE, pl
from ssl_lightning.callbacks.artifacts import RunConfigSaver
from ssl_lightning.cli.app import SSLLightningCLI
from ssl_lightning.cli.errors import CLIError, debug_mode
from ssl_lightning.cli.quiet import quiet_known_warnings
from ssl_lightning.data.datasets import CorruptImageError

__all__ = ["SSLLightningCLI", "main", "resolve_config_names"]

#: The command name in usage lines and advice (the same with the ``ssl-lightning`` script).
PROG = "python -m ssl_lightning"

#: A ``--config`` value that may name a shipped config or shared piece (``simclr``,
#: ``shared/fsdp``), with or without ``.yaml``.
_CONFIG_NAME = re.compile(r"(?:shared/)?[\w-]+(?:\.ya?ml)?")
#: A ``--config`` value meant as a file (not a config given inline as text).
_CONFIG_FILE = re.compile(r"[^\n{}\[\]]+\.(?:ya?ml|json)")


def _shipped_config(value: str) -> str:
    """``value`` itself when it is a file (or a config given inline), else the path of the
    shipped config of that name; a name or file that is neither exits with 2 and the shipped
    names."""
    from ssl_lightning.cli import commands

    is_name = _CONFIG_NAME.fullmatch(value) is not None
    if Path(value).exists() or not (is_name or _CONFIG_FILE.fullmatch(value)):
        return value
    names = commands.config_names()
    shipped = [name for name in names if not name.startswith("shared/")]
    pieces = [name for name in names if name.startswith("shared/")]
    name = re.sub(r"\.ya?ml$", "", value) if is_name else Path(value).stem
    if is_name and name in names:
        return str(names[name])
    close = [c for c in (name, f"shared/{name}") if c in names][:1] or \
        difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    suggestion = f" Did you mean {close[0]!r}?" if close else ""
    sys.stderr.write(f"error: --config {value!r}: no such file in {Path.cwd()}, nor a shipped "
                     f"config of that name.{suggestion} Shipped configs "
                     f"({commands.CONFIGS_DIR}): {', '.join(shipped) or 'none'}."
                     + (f" Pieces to compose after one: {', '.join(pieces)}." if pieces else "")
                     + "\n")
    raise SystemExit(2)


def resolve_config_names(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config NAME`` / ``-c NAME`` / ``--config=NAME`` that is not a file
    but the name of a shipped config (``simclr`` or ``simclr.yaml``, from
    :data:`ssl_lightning.cli.commands.CONFIGS_DIR`) replaced by that config's path."""
    resolved = list(argv)
    for i, arg in enumerate(resolved):
        if arg.startswith("--config="):
            resolved[i] = "--config=" + _shipped_config(arg.removeprefix("--config="))
        elif arg in ("--config", "-c") and i + 1 < len(resolved):
            resolved[i + 1] = _shipped_config(resolved[i + 1])
    return resolved


def main(args: list[str] | None = None, run: bool = True) -> Any:
    """Build and run the CLI.

    Args:
        args: Command-line arguments (``sys.argv[1:]`` when None), e.g.
            ``["fit", "--config", "configs/simclr.yaml"]``; lets tests and scripts call it. A
            ``--config`` that is not a file but a shipped config's name (``simclr``) is resolved
            by :func:`resolve_config_names`.
        run: Run the subcommand; when False, ``args`` must omit the subcommand and the CLI only
            instantiates the trainer, model and data module (for inspection).

    Returns:
        The CLI object (``.trainer``, ``.model``, ``.datamodule``, ``.config``), or the result
        of ``embed`` / ``export``.

    Raises:
        SystemExit: With code 2 for a command-line / config error, 1 for a value a constructor,
            a pre-flight check or a set-up check of the run refused (and for an exception of
            ssl_lightning's own types); the message is on stderr.
    """
    from ssl_lightning.cli.commands import COMMANDS, project_description, run_command

    quiet_known_warnings()
    if NAMESPACE != "pytorch_lightning":  # the shipped configs name pytorch_lightning classes
        sys.stderr.write(f"error: the command line runs on pytorch_lightning, and "
                         f"{NAMESPACE_VARIABLE}={NAMESPACE}: unset it (the Python API works "
                         "under either namespace; docs/configs.md)\n")
        raise SystemExit(2)
    argv = sys.argv[1:] if args is None else list(args)
    if run and argv and argv[0] in COMMANDS and COMMANDS[argv[0]].target:
        return run_command(argv[0], argv[1:])  # LightningCLI's own subcommands: below
    resolved = resolve_config_names(argv)
    if args is not None:
        args = resolved
    elif resolved != argv:  # LightningCLI reads sys.argv (and so do the processes DDP starts)
        sys.argv[1:] = resolved

    try:
        return SSLLightningCLI(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_callback=RunConfigSaver,  # config.yaml in the run's own directory
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": PROG, "description": project_description()},
        )
    except (CLIError, CorruptImageError) as err:  # an unreadable image file, also during fit
        if debug_mode():
            raise
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(1) from err
