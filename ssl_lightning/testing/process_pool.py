"""Two (or N) gloo worker processes started once per test session and reused by every
:func:`distributed_utils.run_in_processes` call: the spawn, the imports of torch, Lightning and
ssl_lightning and the process-group set-up are paid once instead of once per test module.

Every job starts from the state a process spawned at that moment would have: it runs with the
caller's current environment variables and ``sys.path`` (a test may have set ``PYTHONPATH`` or
prepended a folder of its own modules), and before it the worker restores torch's, NumPy's and
Python's random states, torch's default dtype and thread count, and the attributes of every
``ssl_lightning`` module (jobs patch module-level collectives for their known-bad variants, e.g.
``sinkhorn.all_reduce_sum_no_grad``; every submodule is imported at start so that all of them
are restored); modules a job imported from the caller's extra paths are forgotten after it. A
job that fails stops the pool (the other rank may be blocked in a collective); the next job
starts a fresh one. The results travel as ``torch.save`` files, as with
``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import pickle
import pkgutil
import random
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

#: Longest a job may run before the pool is stopped and the test fails (a hang, not a slow job).
JOB_TIMEOUT_S = 1800


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: the rendezvous port of the pool and of every test that
    starts a process group or a multi-node run of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _import_package_modules() -> list[Any]:
    """Every importable ``ssl_lightning`` module (optional extras that are missing are left
    out), so that :class:`_FreshState` restores all of them."""
    import ssl_lightning

    for info in pkgutil.walk_packages(ssl_lightning.__path__, "ssl_lightning."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            continue
    return [m for name, m in sys.modules.items()
            if name.startswith("ssl_lightning") and m is not None]


class _FreshState:
    """What a job may change that the next job must not see, captured once at start."""

    def __init__(self) -> None:
        self.modules = {m: dict(vars(m)) for m in _import_package_modules()}
        self.environ = dict(os.environ)
        self.path = list(sys.path)
        self.torch_rng = torch.random.get_rng_state()
        self.numpy_rng = np.random.get_state()
        self.python_rng = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()

    def enter(self, environ: dict[str, str], path: list[str]) -> list[str]:
        """Restore the state, then take the caller's ``environ`` (keeping this worker's
        rendezvous variables) and ``path``; returns the path entries new to this worker."""
        self.restore()
        os.environ.clear()
        os.environ.update({**environ, **{k: self.environ[k] for k in _RENDEZVOUS}})
        added = [p for p in path if p not in self.path]
        sys.path[:] = path
        return added

    def leave(self, added: list[str]) -> None:
        """Forget the modules imported from ``added`` paths, then restore the state."""
        roots = tuple(os.path.abspath(p) + os.sep for p in added if p)
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if roots and file and os.path.abspath(file).startswith(roots):
                del sys.modules[name]
        self.restore()

    def restore(self) -> None:
        for module, attributes in self.modules.items():
            now = vars(module)
            for name, value in attributes.items():
                if now.get(name) is not value:
                    setattr(module, name, value)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.path[:] = self.path
        torch.random.set_rng_state(self.torch_rng)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)


#: The environment variables of the workers' process group, kept whatever a job's caller has.
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


def _serve(rank: int, world_size: int, port: int, jobs: Any, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fresh = _FreshState()
    while (job := jobs.get()) is not None:
        environ, path, payload, out_dir = job
        added = fresh.enter(environ, path)
        try:  # unpickled here: the job's function may live on the caller's extra path
            fn, args = pickle.loads(payload)
            torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
            error = None if dist.is_initialized() else "the job destroyed the process group"
        except BaseException:  # noqa: BLE001 (reported to the test, which fails)
            error = traceback.format_exc()
        fresh.leave(added)
        results.put((rank, error))
        if not dist.is_initialized():
            return
    dist.destroy_process_group()


class ProcessPool:
    """``world_size`` gloo processes running submitted jobs (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.jobs = [context.SimpleQueue() for _ in range(world_size)]
        self.results = context.Queue()
        port = free_port()
        self.processes = [context.Process(target=_serve, daemon=True,
                                          args=(r, world_size, port, self.jobs[r], self.results))
                          for r in range(world_size)]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable[..., Any], args: tuple) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every process; their results by rank."""
        payload = pickle.dumps((fn, args))
        with tempfile.TemporaryDirectory() as out_dir:
            for queue in self.jobs:
                queue.put((dict(os.environ), list(sys.path), payload, out_dir))
            for _ in range(self.world_size):
                try:
                    rank, error = self.results.get(timeout=JOB_TIMEOUT_S)
                except Exception as err:  # queue.Empty: a hang
                    self.close()
                    raise RuntimeError(f"{fn.__qualname__} did not finish on every process "
                                       f"within {JOB_TIMEOUT_S} s") from err
                if error is not None:
                    self.close()
                    raise RuntimeError(f"{fn.__qualname__} failed on rank {rank}:\n{error}")
            # A full unpickle on purpose: a job may return any picklable value, the job itself
            # reached the workers pickled, and ``out_dir`` is this call's own temporary folder,
            # written only by the workers this pool started.
            return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                    for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)


_pools: dict[int, ProcessPool] = {}


def pool(world_size: int) -> ProcessPool:
    """The session's pool of ``world_size`` processes, started (again) when needed."""
    current = _pools.get(world_size)
    if current is None or not current.alive():
        current = _pools[world_size] = ProcessPool(world_size)
    return current


@atexit.register
def _close_pools() -> None:
    for current in _pools.values():
        for queue in current.jobs:
            queue.put(None)
        for process in current.processes:
            process.join(timeout=10)
        current.close()
