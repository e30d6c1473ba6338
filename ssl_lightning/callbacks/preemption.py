"""Save a resumable checkpoint when the run is asked to stop (SIGTERM from a scheduler, Ctrl-C,
SLURM's requeue signal), then exit with a status that tells a stopped run from a finished one.

Lightning alone stops at the end of the batch on SIGTERM without a checkpoint (status 0, so a
pre-empted job looks finished), turns Ctrl-C into ``KeyboardInterrupt`` (status 1, no
checkpoint), and under DDP broadcasts from inside its SIGTERM handler (a rank that gets the signal
outside the training loop, e.g. in the sanity check, then waits forever for the others). With
:class:`PreemptionCheckpoint` the signal only sets a flag, from the start of ``fit``; at the end
of the next *optimizer* step (never inside a gradient-accumulation cycle), after every other
callback's update of that step (it runs last), the ranks agree on it
(one reduction of the flag, at the same point on every rank), write ``last.ckpt`` (the state
that ``--ckpt_path`` resumes bit-exactly, see ``docs/resume.md``), print the command that resumes
and exit with status 130 (128 + SIGINT) or 143 (128 + SIGTERM), or 0 after it requeued itself on
SLURM (``scontrol requeue``, as Lightning's ``SLURMEnvironment(auto_requeue=True)`` does, but at
a step boundary instead of inside the signal handler). A signal during the sanity check stops the
run at its end, before training, without a checkpoint. The same signal a second time ends the
process at once (by that signal). Once the last training step is done (``on_train_end``), the run
has finished: a stop signal from then on is only noted, and the run writes its summary and export
and exits 0 (with ``ignore_after_finish``, as the CLI sets it, until the process exits).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from ssl_lightning._lightning import (
    ModelCheckpoint,
    SIGTERMException,
    SLURMEnvironment,
    accumulating,
    cluster_environment,
    keep_signal_handlers,
    pl,
    rank_zero_info,
    rank_zero_warn,
    replace_sigterm_notifier,
)

#: Exit status of a run stopped by SIGTERM (or the requeue signal) and not requeued.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
#: Exit status of a run stopped by Ctrl-C (SIGINT).
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT

_Handler = Callable[[int, FrameType | None], Any] | int | None


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM, SIGINT (and SLURM's requeue signal) checkpoint at the next optimizer step and
    exit.

    Args:
        dirpath: Folder of the checkpoint; None uses the first ``ModelCheckpoint``'s folder (so
            the file is the usual ``last.ckpt``), else ``<default_root_dir>/checkpoints``.
        filename: Checkpoint name without ``.ckpt``.
        requeue: Requeue the SLURM job after saving; None: when Lightning runs with
            ``SLURMEnvironment(auto_requeue=True)`` (its default inside a SLURM batch job).
        ignore_after_finish: After a fit whose training finished, keep noting (and ignoring) the
            stop signals after ``fit`` returns, until the process exits, instead of restoring
            the handlers they had before ``fit``: a finished run then exits 0 whatever signal
            comes (the CLI sets it; a notebook keeps the default, its Ctrl-C back).
    """

    def __init__(self, dirpath: str | None = None, filename: str = "last",
                 requeue: bool | None = None, ignore_after_finish: bool = False) -> None:
        super().__init__()
        if not filename:
            raise ValueError("PreemptionCheckpoint filename must not be empty.")
        self.dirpath, self.filename, self.requeue = dirpath, filename, requeue
        self.ignore_after_finish = ignore_after_finish
        self.received: int | None = None  # the signal number, once one arrived in this process
        self.finished = False  # the last training step is done: signals no longer stop the run
        self.saved_path: str | None = None
        self._previous: dict[int, _Handler] = {}

    def _handler(self, signum: int, _: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.finished:
            os.write(2, f"\n{name} received after the last training step: the run has finished "
                        "and exits 0 once its summary and export are written.\n".encode())
            return
        if self.received == signum:  # asked twice: stop now (a checkpoint write is atomic)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        # os.write: a print here could re-enter a print the signal interrupted.
        os.write(2, f"\n{name} received: stopping after the current optimizer step and saving a "
                    f"checkpoint; {name} again stops at once.\n".encode())

    def _signals(self, trainer: pl.Trainer) -> list[int]:
        signals: list[int] = [signal.SIGTERM, signal.SIGINT]
        env = cluster_environment(trainer)
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal:
            signals.append(env.requeue_signal)
        return signals

    def _should_requeue(self, trainer: pl.Trainer) -> bool:
        if self.requeue is not None:
            return self.requeue
        env = cluster_environment(trainer)
        return isinstance(env, SLURMEnvironment) and env.auto_requeue

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """From the start of ``fit`` (or from :meth:`listen`), the stop signals only set a flag."""
        if stage != "fit":
            return
        # Last in the list (after the model's own callbacks and the ModelCheckpoints): the stop
        # checkpoint then holds every callback's update of the step (probe, EMA teacher, ...),
        # the state a checkpoint of a run that was never stopped holds at that step.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]  # type: ignore[attr-defined]
        if not self._previous:
            self.listen(trainer)

    def listen(self, trainer: pl.Trainer) -> None:
        """Make the stop signals set the flag from now on (``setup`` does it; the CLI calls it
        before ``fit``, so that a signal while the data is indexed, before ``setup``, stops the
        run like one in the sanity check instead of raising ``KeyboardInterrupt``: exit 1, and
        under DDP a rank that dies while the others wait for it)."""
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("PreemptionCheckpoint: fit runs outside the main thread, where signal "
                           "handlers cannot be set; stop signals are not handled.")
            return
        self.received, self.saved_path, self.finished = None, None, False
        self._previous = {signum: signal.getsignal(signum) for signum in self._signals(trainer)}
        for signum in self._previous:
            signal.signal(signum, self._handler)
        # Lightning registers its SIGTERM handler later (after on_fit_start), composed with the
        # one in place (ours). Its own part would broadcast inside the handler and stop the run
        # at the end of the batch without a checkpoint: make that part a no-op.
        replace_sigterm_notifier(trainer, _ignore_signal)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last step is done: from now on a stop signal does not stop the run (a signal
        that came after the last step's end, during its validation, is dropped)."""
        self.finished = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give the signals back to the handlers they had before ``fit`` (after a finished fit
        with ``ignore_after_finish``: keep noting them)."""
        if stage != "fit" or not self._previous:
            return
        if self.finished and self.ignore_after_finish:
            self._install(trainer, dict.fromkeys(self._previous, self._handler))
        else:
            self._install(trainer, self._previous)
        self._previous = {}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Restore the previous handlers, or after a stop signal the default ones (a further
        signal ends the process at once, also while Lightning tears down)."""
        if not self._previous:
            return
        if self.received is None:
            self._install(trainer, self._previous)
        else:
            self._install(trainer, dict.fromkeys(self._previous, signal.SIG_DFL))
        self._previous = {}

    def _install(self, trainer: pl.Trainer, handlers: dict[int, _Handler]) -> None:
        """Set ``handlers``, also as the ones Lightning restores when its run ends."""
        for signum, handler in handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        keep_signal_handlers(trainer, handlers)

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

    def _agreed_signal(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """The stop signal any rank received (0 if none): one reduction, called on every rank."""
        received = self.received or 0
        if trainer.world_size > 1:
            flag = torch.tensor(float(received), device=pl_module.device)
            received = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        return received

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        signum = self._agreed_signal(trainer, pl_module)
        if not signum:
            return
        checkpoint = trainer.ckpt_path  # nothing trained yet: the run's own start is the resume
        rank_zero_info(f"Stopped by {signal.Signals(signum).name} before the first training step; "
                       "no checkpoint written. Continue with: "
                       + resume_command(str(checkpoint) if checkpoint else None))
        raise SIGTERMException(_exit_code(signum))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if accumulating(trainer):
            return  # an optimizer step is under way: stop after it
        signum = self._agreed_signal(trainer, pl_module)
        if not signum:
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # said: no Lightning info line
        self.saved_path = path
        requeued = self._should_requeue(trainer) and _requeue_slurm_job(trainer)
        how = "job requeued" if requeued else f"Resume with: {resume_command(path)}"
        rank_zero_info(f"Stopped by {signal.Signals(signum).name} at step {trainer.global_step}; "
                       f"resumable checkpoint: {path}. {how}")
        raise SIGTERMException(0 if requeued else _exit_code(signum))


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """Stands in for Lightning's own SIGTERM notifier while :class:`PreemptionCheckpoint` runs."""


def _exit_code(signum: int) -> int:
    return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else PREEMPTED_EXIT_CODE


def resume_command(checkpoint: str | None) -> str:
    """This process's command line with ``--ckpt_path checkpoint`` (none when ``checkpoint`` is
    None) when it runs the ``ssl_lightning`` CLI, else the ``trainer.fit`` argument."""
    script = Path(sys.argv[0])
    if script.name == "__main__.py" and script.parent.name == "ssl_lightning":
        program = ["python", "-m", "ssl_lightning"]
    elif script.name == "ssl-lightning":
        program = [sys.argv[0]]
    else:
        return f"trainer.fit(..., ckpt_path={checkpoint!r})"
    args, rest = [], iter(sys.argv[1:])
    for arg in rest:
        if arg == "--ckpt_path":
            next(rest, None)
        elif not arg.startswith("--ckpt_path="):
            args.append(arg)
    if checkpoint is not None:
        args += ["--ckpt_path", checkpoint]
    return shlex.join(program + args)


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
