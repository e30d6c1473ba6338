"""Stop signals through the real CLI: ``python -m ssl_lightning fit`` in a subprocess of its own
process group, held at a known point (``tests/preemption_probe.py``) and signalled there.

- Ctrl-C (SIGINT to the whole group, loader workers included): the run finishes the step, writes
  ``last.ckpt`` (loads with ``weights_only=True``), prints the command that resumes, exits 130;
- the same Ctrl-C twice: the process ends at once, by the signal;
- SIGTERM to the whole group (``kill -TERM -PGID``, what SLURM does): the workers survive it, the
  run checkpoints and exits 143, and no worker outlives the run;
- 2 processes (``--trainer.strategy ddp``, gloo) with SIGTERM to rank 1 during the sanity check:
  both ranks stop at its end and exit 143, no hang;
- SIGTERM after the last training step (while the summary prints): noted, the run exits 0;
- 2 processes, Ctrl-C while rank 1 still indexes its training images (before the callbacks'
  ``setup``): both ranks stop at the sanity check's end and exit 130, no traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from preemption_probe import child_pids
from product_matrix import shrink_args

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "simclr.yaml"
TIMEOUT_S = 300  # a whole run on the loaded 2-core machine takes ~1 minute


class Run:
    """``python -m ssl_lightning fit`` on the shrunk SimCLR config, stderr in a file."""

    def __init__(self, workdir: Path, data_root: Path, world_size: int, probe: dict[str, Any],
                 extra: list[str]) -> None:
        workdir.mkdir()
        self.workdir, self.marker = workdir, workdir / "hold"
        probe["init_args"]["marker"] = str(self.marker)
        self.args = ["fit", "--config", str(CONFIG), *shrink_args(CONFIG, data_root, world_size),
                     *extra, f"--trainer.callbacks+={json.dumps(probe)}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        self.stderr_path = workdir / "stderr.txt"
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ssl_lightning", *self.args], cwd=workdir, env=env,
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for(self, predicate: Any, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not predicate():
            assert self.process.poll() is None, f"exited before {what}:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def held(self, rank: int = 0) -> dict[str, Any]:
        path = Path(f"{self.marker}.rank{rank}")
        self.wait_for(path.exists, f"rank {rank} to hold")
        time.sleep(0.2)  # the marker is written before the wait starts
        return json.loads(path.read_text())

    def signal_group(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)

    def wait(self, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit {timeout} s after the signal:\n{self.stderr[-3000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def start(tmp_path: Path, tiny_image_folder: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def make(probe: str, world_size: int = 1, extra: tuple[str, ...] = (),
             **probe_args: Any) -> Run:
        spec = {"class_path": f"preemption_probe.{probe}", "init_args": probe_args}
        runs.append(Run(tmp_path / f"run{len(runs)}", tiny_image_folder, world_size, spec,
                        list(extra)))
        return runs[-1]

    yield make
    for run in runs:
        run.kill()


WORKERS = ("--data.init_args.num_workers", "2")


def _checkpoint(run: Run) -> Path:
    found = list(run.workdir.glob("runs/simclr/version_0/checkpoints/last.ckpt"))
    assert found, run.stderr[-3000:]
    return found[0]


def _resume_line(run: Run) -> list[str]:
    lines = [line for line in run.stderr.splitlines() if "Resume with: " in line]
    assert lines, run.stderr[-3000:]
    return shlex.split(lines[-1].split("Resume with: ", 1)[1])


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_ctrl_c_saves_prints_the_resume_command_and_exits_130(start: Any) -> None:
    run = start("HoldAtStep", step=2, extra=WORKERS)
    held = run.held()
    assert len(held["children"]) >= 2  # the training loader's workers are alive
    run.signal_group(signal.SIGINT)  # what Ctrl-C in a terminal sends
    assert run.wait() == 130, run.stderr[-3000:]
    assert "Stopped by SIGINT at step 3" in run.stderr
    path = _checkpoint(run)
    assert torch.load(path, weights_only=True)["global_step"] == 3
    command = _resume_line(run)  # the same command, from the same directory, plus --ckpt_path
    assert command[:-2] == ["python", "-m", "ssl_lightning", *run.args]
    assert command[-2] == "--ckpt_path" and (run.workdir / command[-1]).resolve() == path.resolve()


def test_second_ctrl_c_stops_at_once(start: Any) -> None:
    run = start("HoldAtStep", step=1, keep_holding=True, hold_s=120)
    run.held()
    run.signal_group(signal.SIGINT)
    run.wait_for(lambda: "SIGINT received" in run.stderr, "the first SIGINT")
    sent = time.monotonic()
    run.signal_group(signal.SIGINT)
    assert run.wait(timeout=60) == -signal.SIGINT, run.stderr[-3000:]
    assert time.monotonic() - sent < 60  # the step still held: not waited for


def test_sigterm_to_the_process_group_spares_the_workers(start: Any) -> None:
    run = start("HoldAtStep", step=2, extra=WORKERS)
    workers = run.held()["children"]
    assert len(workers) >= 2
    run.signal_group(signal.SIGTERM)  # kill -TERM -PGID
    assert run.wait() == 143, run.stderr[-3000:]
    assert "is killed by signal" not in run.stderr
    assert "Stopped by SIGTERM at step 3" in run.stderr
    assert torch.load(_checkpoint(run), weights_only=True)["global_step"] == 3
    deadline = time.monotonic() + 30  # a worker whose parent is gone exits within ~5 s
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, f"loader workers outlived the run: {workers}"
        time.sleep(0.1)


def test_ddp_sigterm_to_rank_1_in_the_sanity_check_stops_both_ranks(start: Any) -> None:
    run = start("HoldInSanityCheck", world_size=2, rank=1,
                extra=("--trainer.num_sanity_val_steps", "1"))
    rank1 = run.held(rank=1)["pid"]
    assert rank1 in child_pids(run.process.pid)
    os.kill(rank1, signal.SIGTERM)
    assert run.wait(timeout=180) == 143, run.stderr[-3000:]
    assert "Stopped by SIGTERM before the first training step" in run.stderr
    deadline = time.monotonic() + 60
    while not _gone(rank1):
        assert time.monotonic() < deadline, "rank 1 outlived rank 0"
        time.sleep(0.1)


def test_ddp_ctrl_c_while_rank_1_indexes_its_data_stops_both_ranks(start: Any) -> None:
    run = start("HoldInSanityCheck", world_size=2, rank=0,
                extra=("--trainer.num_sanity_val_steps", "1",
                       "--data.class_path", "preemption_probe.HoldInDataSetup",
                       "--data.init_args.marker", "hold"))  # relative to the run's folder
    run.wait_for((run.workdir / "hold.data.rank1").exists, "rank 1 to index its data")
    time.sleep(0.2)  # the marker is written before the wait starts
    run.signal_group(signal.SIGINT)
    assert run.wait(timeout=180) == 130, run.stderr[-3000:]
    assert "Stopped by SIGINT before the first training step" in run.stderr
    assert "Traceback" not in run.stderr


def test_sigterm_after_the_last_step_lets_the_finished_run_exit_0(start: Any) -> None:
    run = start("HoldInTeardown", hold_s=10)
    run.held()
    run.signal_group(signal.SIGTERM)
    assert run.wait() == 0, run.stderr[-3000:]
    assert "SIGTERM received after the last training step" in run.stderr
