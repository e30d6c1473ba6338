"""The run's own directory, and the files written there logged to the experiment tracker.

:attr:`Trainer.log_dir` is a run's own folder only for TensorBoard and CSV loggers; for any other
logger it is the logger's ``save_dir``, which all runs share (with MLflow: ``mlruns/``, so every
run's ``config.yaml`` and pictures would land on, and overwrite, the same files).
:func:`run_directory` is the folder Lightning's ``ModelCheckpoint`` puts ``checkpoints/`` into:
``<save_dir>/<name>/<version>`` (MLflow: ``<save_dir>/<experiment id>/<run id>``, W&B:
``<save_dir>/<project>/<run id>``), ``trainer.log_dir`` for TensorBoard / CSV, and
``default_root_dir`` without a logger. :func:`log_run_file` hands a file written there to the
tracker as well: an MLflow run artifact at the same path relative to the run directory, a W&B
artifact ``run-<run id>-<that path>``; TensorBoard and CSV runs keep it in the run directory.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.cli import SaveConfigCallback
from pytorch_lightning.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger


def _local_run_directory(trainer: pl.Trainer) -> str:
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
    return trainer.strategy.broadcast(_local_run_directory(trainer))


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary name in ``path``'s directory (created if needed) to write to; it is
    renamed onto ``path`` when the block ends, or removed if the block raises."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def log_run_file(trainer: pl.Trainer, path: str | os.PathLike, run_dir: str) -> None:
    """Log the file ``path`` to each MLflow / W&B logger of ``trainer`` (call on global rank 0).

    Its place among the run's artifacts is its path relative to ``run_dir`` (a file outside
    ``run_dir`` goes to the artifacts' top level).
    """
    path = os.path.abspath(path)
    run_dir = os.path.abspath(run_dir)
    inside = os.path.commonpath([path, run_dir]) == run_dir
    base = run_dir if inside else os.path.dirname(path)
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            folder = os.path.relpath(os.path.dirname(path), base)
            logger.experiment.log_artifact(logger.run_id, path,
                                           None if folder == "." else folder)
        elif isinstance(logger, WandbLogger):
            import wandb

            run = logger.experiment
            relative = os.path.relpath(path, base)
            name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"run-{run.id}-{relative}")
            artifact = wandb.Artifact(name, type="run-file")
            artifact.add_file(path, name=relative)
            run.log_artifact(artifact)


class RunConfigSaver(SaveConfigCallback):
    """LightningCLI's config saver, writing ``config.yaml`` into :func:`run_directory` (not the
    shared ``trainer.log_dir`` of MLflow / W&B runs) and logging it to the tracker.

    The file is written to a temporary name and renamed; ``overwrite=False`` refuses an existing
    one, as LightningCLI's saver does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.multifile:
            raise ValueError("RunConfigSaver writes one config file; pass multifile=False.")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        run_dir = run_directory(trainer)
        path = os.path.join(run_dir, self.config_filename)
        exists = trainer.strategy.broadcast(trainer.is_global_zero and os.path.isfile(path))
        if exists and not self.overwrite:
            raise RuntimeError(
                f"{path} exists (the config of an earlier run in this directory); pass "
                "save_config_kwargs={'overwrite': True} or choose another run directory."
            )
        if trainer.is_global_zero and self.save_to_log_dir:
            write_text(path, self.parser.dump(self.config, skip_none=False))
            log_run_file(trainer, path, run_dir)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
        self.already_saved = True


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`replacing`."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
