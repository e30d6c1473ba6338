"""A process that imports ssl_lightning destroys its default process group before it exits
(a gloo group left to the interpreter's shutdown can abort a finished run with SIGABRT)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ssl_lightning.distributed import destroy_process_group_at_exit

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# The check is registered before the import, so atexit runs it after the package's handler.
PROGRAM = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("initialised at exit:", dist.is_initialized()))
import ssl_lightning
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
dist.all_reduce(__import__("torch").ones(1))
"""


def test_the_process_group_is_destroyed_at_exit() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "initialised at exit: False" in result.stdout


def test_destroy_without_a_process_group_does_nothing() -> None:
    assert not dist.is_initialized()
    destroy_process_group_at_exit()
    assert not dist.is_initialized()
