"""Loader workers survive a stop signal sent to the whole process group, and never keep the main
process from exiting.

Ctrl-C and a scheduler's SIGTERM (``kill -TERM -PGID``, SLURM at its time limit) reach every
process of the group; the main process, not a dying worker, decides how the run stops
(:class:`~ssl_lightning.callbacks.PreemptionCheckpoint`), so workers ignore both signals. The
main process shuts its workers down as it exits, and a worker exits when its parent is gone. One
case needs help: multiprocessing's own exit handler stops daemonic children with SIGTERM and then
waits for them, which would wait forever for workers of a loader that an exception's traceback
kept alive; :func:`kill_leftover_workers` (run at exit, before that handler) kills them first.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.util  # registers its exit handler now, so ours (later) runs first
import signal


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of the loaders: the worker ignores SIGINT and SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def kill_leftover_workers() -> None:
    """SIGKILL the daemonic child processes (loader workers) still alive at interpreter exit,
    which multiprocessing's exit handler would stop with SIGTERM anyway; torch's SIGCHLD handler
    is reset first, since it would report the workers' deaths as an error."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()


atexit.register(kill_leftover_workers)
