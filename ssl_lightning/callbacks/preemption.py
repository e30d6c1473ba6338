"""Save a resumable checkpoint when the scheduler asks the job to stop (SIGTERM / SLURM's
requeue signal), then exit with a status that tells a pre-empted run from a finished one.

Lightning's own SIGTERM handling stops the run at the end of the current batch without a
checkpoint and exits with status 0, so a pre-empted job looks finished. With
:class:`PreemptionCheckpoint` the run instead stops at the end of the current *optimizer* step
(never inside a gradient-accumulation cycle), writes ``last.ckpt`` (the state that
``--ckpt_path`` resumes bit-exactly, see ``docs/resume.md``) and exits with status 143 (128 +
SIGTERM), or 0 after it requeued itself on SLURM (``scontrol requeue``, as Lightning's
``SLURMEnvironment(auto_requeue=True)`` does, but at a step boundary instead of inside the
signal handler, whose checkpoint can be taken in the middle of an optimizer step).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from pytorch_lightning.utilities.exceptions import SIGTERMException

#: Exit status of a run stopped by a signal and not requeued (the shell's 128 + SIGTERM).
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM (and SLURM's requeue signal) checkpoint at the next optimizer step and exit.

    Args:
        dirpath: Folder of the checkpoint; None uses the first ``ModelCheckpoint``'s folder (so
            the file is the usual ``last.ckpt``), else ``<default_root_dir>/checkpoints``.
        filename: Checkpoint name without ``.ckpt``.
        requeue: Requeue the SLURM job after saving; None: when Lightning runs with
            ``SLURMEnvironment(auto_requeue=True)`` (its default inside a SLURM batch job).
    """

    def __init__(self, dirpath: str | None = None, filename: str = "last",
                 requeue: bool | None = None) -> None:
        super().__init__()
        if not filename:
            raise ValueError("PreemptionCheckpoint filename must not be empty.")
        self.dirpath, self.filename, self.requeue = dirpath, filename, requeue
        self.received: int | None = None  # the signal number, once one arrived
        self.saved_path: str | None = None

    def _handler(self, signum: int, _: FrameType | None) -> None:
        self.received = signum

    def _signals(self, trainer: pl.Trainer) -> list[int]:
        signals: list[int] = [signal.SIGTERM]
        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal:
            signals.append(env.requeue_signal)
        return signals

    def _should_requeue(self, trainer: pl.Trainer) -> bool:
        if self.requeue is not None:
            return self.requeue
        env = trainer._accelerator_connector.cluster_environment
        return isinstance(env, SLURMEnvironment) and env.auto_requeue

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning registered its handlers (which stop without a checkpoint): replace
        # them; Lightning restores the previous handlers when the run ends.
        for signum in self._signals(trainer):
            signal.signal(signum, self._handler)

    def checkpoint_path(self, trainer: pl.Trainer) -> str:
        """Where the checkpoint goes (see ``dirpath``)."""
        dirpath: str | Path | None = self.dirpath
        if dirpath is None:
            callbacks = trainer.callbacks  # type: ignore[attr-defined]
            model_checkpoint = next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None)
            dirpath = model_checkpoint.dirpath if model_checkpoint is not None else None
        if dirpath is None:
            dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        return str(Path(dirpath) / f"{self.filename}.ckpt")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return  # an optimizer step is under way: stop after it
        received = self.received is not None
        if trainer.world_size > 1:  # every rank stops at the same step, if any rank got it
            flag = torch.tensor(float(received), device=pl_module.device)
            received = bool(trainer.strategy.reduce(flag, reduce_op="max").item())
        if not received:
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self.saved_path = path
        requeued = self._should_requeue(trainer) and _requeue_slurm_job(trainer)
        rank_zero_info(f"Stopped by signal {self.received} at step {trainer.global_step}; "
                       f"resumable checkpoint: {path}" + ("; job requeued" if requeued else ""))
        raise SIGTERMException(0 if requeued else PREEMPTED_EXIT_CODE)


def _requeue_slurm_job(trainer: pl.Trainer) -> bool:
    """``scontrol requeue`` this SLURM job from global rank 0; True when that succeeded."""
    ok = torch.tensor(0.0)
    if trainer.is_global_zero:
        array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = (f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job
               else os.environ.get("SLURM_JOB_ID"))
        if job is None:
            rank_zero_warn("PreemptionCheckpoint: requeue asked for outside a SLURM job.")
        else:
            result = subprocess.run(["scontrol", "requeue", job], check=False)
            ok.fill_(float(result.returncode == 0))
            if result.returncode != 0:
                rank_zero_warn(f"scontrol requeue {job} failed (status {result.returncode}).")
    return bool(trainer.strategy.broadcast(ok, src=0).item())
