"""Loader workers ignore SIGINT / SIGTERM, yet a process whose loader an exception kept alive
still exits: multiprocessing's exit handler would SIGTERM those workers and wait forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch.utils.data import DataLoader
    from ssl_lightning.data.worker_signals import ignore_stop_signals

    loader = DataLoader(list(range(64)), batch_size=2, num_workers=2,
                        worker_init_fn=ignore_stop_signals)
    iterator = iter(loader)
    for _ in range(2):  # batches come in worker order: both workers have run worker_init_fn
        next(iterator)
    print("pids", *[w.pid for w in iterator._workers], flush=True)
    sys.stdin.readline()  # the test sends its signals meanwhile
    try:
        raise RuntimeError("an error mid-epoch")
    except RuntimeError as err:
        kept = err  # the traceback keeps the iterator (and its workers) alive
    sys.exit(3)
""")


def test_workers_ignore_stop_signals_and_the_process_still_exits(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    pids = [int(pid) for pid in process.stdout.readline().split()[1:]]  # type: ignore[union-attr]
    for pid in pids:  # a group-wide stop signal: the workers survive it
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    assert all(_alive(pid) for pid in pids)
    try:
        process.communicate("\n", timeout=60)
        code = process.returncode
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 3, "the process did not exit on its own"
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for our purposes
        return stat.read().split()[2] != "Z"
