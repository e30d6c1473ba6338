"""LightningCLI wiring: ``python -m ssl_lightning fit --config configs/simclr.yaml``.

Model and data module are chosen in subclass mode, so a config names any ``LightningModule``
(every :class:`~ssl_lightning.methods.SSLMethod`, and the linear-evaluation module, which is not
one) and any ``LightningDataModule`` by ``class_path``; the public classes of ``ssl_lightning``
can be named without their module (``class_path: SimCLR``). ``--help``, ``--print_config`` and
overrides such as ``--model.temperature 0.2`` are LightningCLI's. Errors are printed as
``error: <message>`` with a non-zero exit code, and ``--ckpt_path`` resumes the run the config
describes (see ``docs/cli.md``).
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl

from ssl_lightning.callbacks.artifacts import RunConfigSaver
from ssl_lightning.cli.app import SSLLightningCLI
from ssl_lightning.cli.errors import CLIError, debug_mode

__all__ = ["SSLLightningCLI", "main"]


def main(args: list[str] | None = None, run: bool = True) -> Any:
    """Build and run the CLI.

    Args:
        args: Command-line arguments (``sys.argv[1:]`` when None), e.g.
            ``["fit", "--config", "configs/simclr.yaml"]``; lets tests and scripts call it.
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
    import ssl_lightning  # noqa: F401  (imports every public class so short class_path names resolve)
    from ssl_lightning.commands import EXTRA_COMMANDS, project_description

    argv = sys.argv[1:] if args is None else list(args)
    if run and argv and argv[0] in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[argv[0]](argv[1:])

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
            parser_kwargs={"description": project_description()},
        )
    except CLIError as err:
        if debug_mode():
            raise
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(1) from err
