"""Files are complete or absent: atomic writes, checkpoints that survive SIGKILL and a full
disk, and one live run per run directory."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from disk_utils import SMALL_DISK_BYTES, small_tmpfs
from evaluation_helpers import tiny_trainer
from torch.utils.data import DataLoader

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.io import (
    AtomicCheckpointIO,
    RunDirectoryInUseError,
    RunDirectoryLock,
    atomic,
    atomic_open,
    lock_run_directory,
    with_atomic_checkpoint_io,
)
from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import PrecomputedViews

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(value: float, floats: int) -> dict:
    return {"state_dict": {"w": torch.full((floats,), value)}, "epoch": int(value)}


def test_atomic_open_keeps_the_existing_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(KeyError), atomic_open(target) as handle:
        handle.write(b"new, half written")
        raise KeyError("fails mid-write")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    with atomic_open(target) as handle:
        handle.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]
    with pytest.raises(IsADirectoryError, match="is a directory"), atomic_open(tmp_path):
        pass


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small_disk") as mount_point:
        yield mount_point


def test_a_full_disk_keeps_the_previous_checkpoint(small_disk):
    last = small_disk / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0, 50_000), last)  # 200 kB
    before = last.read_bytes()
    with pytest.raises(OSError, match=r"No space left.*last\.ckpt|last\.ckpt.*No space left"):
        io.save_checkpoint(_checkpoint(2.0, SMALL_DISK_BYTES // 4), last)  # > the disk
    assert last.read_bytes() == before and os.listdir(small_disk) == ["last.ckpt"]
    assert torch.load(last, weights_only=True)["epoch"] == 1


class _Stalls:
    """A file that takes the first 100 kB written to it, then stalls until killed."""

    def __init__(self, handle, ready: int) -> None:
        self.handle, self.ready = handle, ready

    def write(self, data) -> None:
        self.handle.write(bytes(data[:100_000]))
        self.handle.flush()
        os.write(self.ready, b"x")
        time.sleep(600)


@contextmanager
def _in_child(work: Callable[[int], None]) -> Iterator[None]:
    """Fork a child that runs ``work(ready_fd)``, wait until it writes to ``ready_fd``, run the
    block, then SIGKILL the child (a fork: the child needs no second import of torch)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(read)
            work(write)
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"x", "the child failed before it was ready"
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    last = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(1.0, 50_000), last)
    before = last.read_bytes()
    new = _checkpoint(2.0, 500_000)  # made here: no torch kernels in the forked child

    def save_and_stall(ready: int) -> None:
        real_open = atomic.atomic_open

        @contextmanager
        def stalling_open(*args, **kwargs):
            with real_open(*args, **kwargs) as handle:
                yield _Stalls(handle, ready)

        monkeypatch.setattr(atomic, "atomic_open", stalling_open)
        AtomicCheckpointIO().save_checkpoint(new, last)

    with _in_child(save_and_stall):
        partial = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
        assert len(partial) == 1 and partial[0].stat().st_size == 100_000  # killed mid-write
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=True)["epoch"] == 1


def test_with_atomic_checkpoint_io_keeps_a_checkpoint_io_the_user_chose():
    from lightning_fabric.plugins import TorchCheckpointIO

    own = TorchCheckpointIO()
    assert with_atomic_checkpoint_io([own]) == [own]
    assert isinstance(with_atomic_checkpoint_io(None)[0], AtomicCheckpointIO)


def _fit(root: Path) -> None:
    model = SimCLR(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                   optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
    trainer = tiny_trainer(max_steps=1, default_root_dir=str(root),
                           callbacks=[RunDirectoryLock()])
    trainer.fit(model, DataLoader(PrecomputedViews(8, (8, 8)), batch_size=4))


def _held(directory: Path):
    """A live child process holding ``directory``'s run lock while the block runs."""

    def hold(ready: int) -> None:
        lock = lock_run_directory(directory)
        os.write(ready, b"x")
        time.sleep(600)
        lock.release()

    return _in_child(hold)


def test_a_run_directory_another_live_run_holds_is_refused_and_freed_by_its_death(tmp_path):
    with _held(tmp_path), pytest.raises(RunDirectoryInUseError) as refused:
        _fit(tmp_path)
    message = str(refused.value)
    assert str(tmp_path) in message and "--trainer.logger.init_args.version" in message
    assert "wait" in message
    _fit(tmp_path)  # the dead holder's lock file does not block
    _fit(tmp_path)  # nor does this process's finished run


def test_cli_fit_writes_checkpoints_atomically_and_locks_its_run_directory(
        run_config, tmp_path, capsys):
    cli = run_config(REPO / "configs" / "simclr.yaml")
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    version = tmp_path / "runs" / "simclr" / "held"
    with _held(version), pytest.raises(SystemExit) as refused:
        run_config(REPO / "configs" / "simclr.yaml", [
            "--trainer.fast_dev_run", "false", "--trainer.max_steps", "1",
            "--trainer.logger.init_args.version", "held"])
    assert refused.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: RunDirectoryInUseError: The run directory ") and "held" in line
    assert not (version / "config.yaml").exists()
