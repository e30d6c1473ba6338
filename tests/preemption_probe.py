"""Callbacks that hold a CLI run at a known point until a stop signal arrived, so that
``tests/callbacks/test_preemption.py`` can signal it there (named by ``--trainer.callbacks+=``).

Each writes ``<marker>.rank<r>`` (JSON: the process id and the ids of its child processes, the
loader workers) when it starts holding, then waits until the run's
:class:`~ssl_lightning.callbacks.PreemptionCheckpoint` recorded a signal (at most ``hold_s``), and
with ``keep_holding`` goes on holding (a long step) until ``hold_s`` is over.
:class:`HoldInDataSetup` is a data module that holds that way while it indexes its training
images (slowly, on one rank), before the callbacks' ``setup``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from ssl_lightning.callbacks import PreemptionCheckpoint
from ssl_lightning.data import CIFAR10DataModule


def child_pids(pid: int) -> list[int]:
    """Ids of the live processes whose parent is ``pid`` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


class _Hold(pl.Callback):
    def __init__(self, marker: str, hold_s: float = 60.0, keep_holding: bool = False,
                 rank: int | None = None) -> None:
        self.marker, self.hold_s, self.keep_holding, self.rank = marker, hold_s, keep_holding, rank
        self.done = False

    def hold(self, trainer: pl.Trainer) -> None:
        if self.done or (self.rank is not None and trainer.global_rank != self.rank):
            return
        self.done = True
        preemption = next(c for c in trainer.callbacks  # type: ignore[attr-defined]
                          if isinstance(c, PreemptionCheckpoint))
        info: dict[str, Any] = {"pid": os.getpid(), "children": child_pids(os.getpid())}
        Path(f"{self.marker}.rank{trainer.global_rank}").write_text(json.dumps(info))
        deadline = time.monotonic() + self.hold_s
        while (self.keep_holding or preemption.received is None) and time.monotonic() < deadline:
            time.sleep(0.01)


class HoldAtStep(_Hold):
    """Hold at the start of the training batch of optimizer step ``step``."""

    def __init__(self, marker: str, step: int, **kwargs: Any) -> None:
        super().__init__(marker, **kwargs)
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.hold(trainer)


class HoldInSanityCheck(_Hold):
    """Hold at the start of the sanity check (on rank ``rank`` only, when given)."""

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hold(trainer)


class HoldInTeardown(_Hold):
    """Hold in ``teardown`` after a finished fit (where the run's summary prints), at most
    ``hold_s`` (a signal there no longer sets the flag)."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.hold(trainer)


class HoldInDataSetup(CIFAR10DataModule):
    """CIFAR10DataModule whose ``build_train`` (the indexing of the training images, in ``setup``
    before the callbacks' ``setup``) holds on rank ``hold_rank`` (writing ``marker``) until a
    stop signal arrived, at most ``hold_s``."""

    def __init__(self, *args: Any, marker: str = "", hold_rank: int = 1, hold_s: float = 60.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker, self.hold_rank, self.hold_s = marker, hold_rank, hold_s

    def build_train(self, transform: Any) -> Any:
        assert self.trainer is not None
        _Hold(f"{self.marker}.data", hold_s=self.hold_s, rank=self.hold_rank).hold(self.trainer)
        return super().build_train(transform)
