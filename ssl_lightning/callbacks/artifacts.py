"""Files of a run logged to the experiment tracker.

Files go to the run's own folder (:func:`ssl_lightning.io.run_directory`; not
:attr:`Trainer.log_dir`, which MLflow and W&B runs share). :func:`log_run_file` hands a file
written there to the tracker as well: an MLflow run artifact at the same path relative to the
run directory, a W&B artifact ``run-<run id>-<that path>``; TensorBoard and CSV runs keep it in
the run directory.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ssl_lightning._lightning import MLFlowLogger, SaveConfigCallback, WandbLogger, pl
from ssl_lightning.io import atomic_open, run_directory


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
    """Write ``text`` to ``path`` atomically (:func:`~ssl_lightning.io.atomic_open`)."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
