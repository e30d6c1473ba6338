"""The run's own directory: where its checkpoints, config and pictures go.

:attr:`Trainer.log_dir` is a run's own folder only for TensorBoard and CSV loggers; for any other
logger it is the logger's ``save_dir``, which all runs share (with MLflow: ``mlruns/``).
:func:`run_directory` is the folder Lightning's ``ModelCheckpoint`` puts ``checkpoints/`` into:
``<save_dir>/<name>/<version>`` (MLflow: ``<save_dir>/<experiment id>/<run id>``, W&B:
``<save_dir>/<project>/<run id>``), ``trainer.log_dir`` for TensorBoard / CSV, and
``default_root_dir`` without a logger.
"""

from __future__ import annotations

import os
from pathlib import Path

from ssl_lightning._lightning import CSVLogger, TensorBoardLogger, pl


def local_run_directory(trainer: pl.Trainer) -> str:
    """This process's idea of :func:`run_directory` (no collective: also before ``fit``)."""
    if not trainer.loggers:
        return trainer.default_root_dir
    logger = trainer.loggers[0]
    if isinstance(logger, (TensorBoardLogger, CSVLogger)):
        return logger.log_dir
    version = logger.version
    return os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name),
                        version if isinstance(version, str) else f"version_{version}")


def run_directory(trainer: pl.Trainer) -> str:
    """This run's own directory (global rank 0's; a broadcast under DDP: call it on every rank)."""
    return trainer.strategy.broadcast(local_run_directory(trainer))


def latest_checkpoint(runs: Path, file_name: str) -> Path | None:
    """The most recently written ``<runs>/<run>/checkpoints/<file_name>``, None if there is none."""
    found = [path for path in runs.glob(f"*/checkpoints/{file_name}") if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime_ns, default=None)
