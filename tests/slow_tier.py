"""The slow tier is marked on the tests themselves: ``pytestmark = pytest.mark.slow`` in the file
or ``@pytest.mark.slow`` on the test (``-m "not slow"`` is the fast inner loop, under 3 minutes on
2 cores). A test not marked slow fails if it starts a process: a Python subprocess (a CLI run, a
script, torchrun), a spawned ``multiprocessing`` process (the process pool, DDP spawns, a
multi-process Trainer), or a job on the session's process pool. Forked processes (DataLoader
workers) and other programs (``mount``) cost milliseconds and are allowed. The hooks here are
imported by ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

SLOW_MARK_NEEDED = "starts processes but is not marked slow (add @pytest.mark.slow or pytestmark)"

#: Modules whose own one-off probes are no test's process: typeshed_client asks the interpreter
#: for its ``sys.path`` once per session, for whichever test first builds a CLI parser.
LIBRARY_PROBES = ("typeshed_client",)

def _runs_python(args: object, executable: object) -> bool:
    program = executable or (args if isinstance(args, (str, bytes, os.PathLike))
                             else next(iter(args), ""))  # type: ignore[call-overload]
    name = os.path.basename(os.fsdecode(program).split()[0] if program else "")
    return name.startswith("python") or os.fsdecode(program) == sys.executable


def _from_library_probe() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(LIBRARY_PROBES):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextmanager
def _recording_process_starts(starts: list[str]) -> Iterator[None]:
    """Record in ``starts`` each process start (or pool job) inside the block that counts."""
    import multiprocessing.process

    from ssl_lightning.testing import process_pool

    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start
    pool_run = process_pool.ProcessPool.run

    def record_popen(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        if _runs_python(args, kwargs.get("executable")) and not _from_library_probe():
            starts.append(f"subprocess {args!r}"[:200])
        popen_init(self, args, *rest, **kwargs)

    def record_process(self):  # type: ignore[no-untyped-def]
        process_start(self)
        if getattr(self._popen, "method", "fork") != "fork":
            starts.append(f"{self._popen.method} process {self.name} "
                          f"({getattr(self, '_target', None)!r})"[:200])

    def record_job(self, fn, args):  # type: ignore[no-untyped-def]
        starts.append(f"process pool job {fn.__qualname__}")
        return pool_run(self, fn, args)

    subprocess.Popen.__init__ = record_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = record_process  # type: ignore[method-assign]
    process_pool.ProcessPool.run = record_job  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign]
        process_pool.ProcessPool.run = pool_run  # type: ignore[method-assign]


def _guarded(item: pytest.Item) -> Iterator[None]:
    """Run a test phase; fail the test when it started a process without the ``slow`` mark."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    starts: list[str] = []
    with _recording_process_starts(starts):
        result = yield
    if starts:
        pytest.fail(f"{item.nodeid} {SLOW_MARK_NEEDED}: {starts[0]}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))
