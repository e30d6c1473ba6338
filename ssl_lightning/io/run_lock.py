"""One live run per run directory: a lock file held for the whole ``fit``.

Two fits writing to the same version directory would leave one run's ``config.yaml`` beside the
other's ``last.ckpt``. :class:`RunDirectoryLock` takes an exclusive lock on
``<log_dir>/run.lock`` when ``fit`` starts (on global rank 0) and refuses the run when another
live process holds it. The lock is an OS file lock (``filelock``): it dies with the process that
held it, so the lock file a killed run leaves behind does not block the next run.
"""

from __future__ import annotations

import os

from filelock import FileLock, Timeout

from ssl_lightning._lightning import pl
from ssl_lightning.io.run_directory import run_directory

#: Name of the lock file in the run directory.
LOCK_NAME = "run.lock"


class RunDirectoryInUseError(RuntimeError):
    """Another live run holds the run directory."""


def lock_run_directory(directory: str | os.PathLike) -> FileLock:
    """Hold ``directory``'s lock (created if needed) until ``.release()`` or process exit.

    Raises:
        RunDirectoryInUseError: Another live process holds it; the message names the directory
            and what to do.
    """
    os.makedirs(directory, exist_ok=True)
    lock = FileLock(os.path.join(directory, LOCK_NAME), timeout=0)
    try:
        lock.acquire()
    except Timeout as err:
        raise RunDirectoryInUseError(
            f"The run directory {os.fspath(directory)!r} is in use by another live run (it "
            f"holds {LOCK_NAME}). Give this run its own directory "
            "(--trainer.logger.init_args.version <new name>, or another "
            "--trainer.default_root_dir), or wait until that run ends."
        ) from err
    return lock


class RunDirectoryLock(pl.Callback):
    """Holds the lock of ``trainer.log_dir`` from the start of ``fit`` to its end (see the
    module docstring). A run without a run directory (``fast_dev_run`` replaces the logger) is
    not locked."""

    def __init__(self) -> None:
        self._lock: FileLock | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._lock is not None:
            return
        if trainer.log_dir is None:  # a broadcast: every rank reads it
            return
        log_dir = run_directory(trainer)  # its own folder also when the logger's is shared
        refusal = None
        if trainer.is_global_zero:
            try:
                self._lock = lock_run_directory(log_dir)
            except RunDirectoryInUseError as err:
                refusal = str(err)
        refusal = trainer.strategy.broadcast(refusal)  # every rank stops together
        if refusal is not None:
            raise RunDirectoryInUseError(refusal)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
