"""Property of every registered method: 2 processes equal 1 process fed the global batch in the
sampler's own order.

Each method's small instance trains 3 float64 steps by Lightning on 2 CPU processes
(``strategy="ddp"``, gloo, batches of 4 per rank, samples carrying their seeds so masks and drop
path are keyed by sample) and on one process fed batches of 8 in ``DistributedSampler``'s order
(rank r holds positions r, r + W, ... of it: what a 1-GPU run with that order sees). The
weights and buffers agree to 1e-9 relative; queues are compared as contents (their slots follow
the enqueue order, which is the gathered rank-major order under DDP). Every decision that
depends on a sample's position in the batch must therefore be keyed by its global sampler
position. One pool job (``run_in_processes``) trains every method. A method that opts out of
``ddp_equals_one_process`` is skipped with its reason printed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from distributed_utils import run_in_processes
from opt_outs import skip_opted_out
from torch import Tensor
from torch.utils.data import Subset

from ssl_lightning.methods.registry import MethodEntry, method_entries
from ssl_lightning.testing.differences import state_differences
from ssl_lightning.testing.trainer_runs import (
    KeyedViews,
    TensorDataModule,
    ddp_global_order,
)

pytestmark = pytest.mark.slow

ENTRIES = method_entries()
BATCH, STEPS, SAMPLES, WORLD = 4, 3, 24, 2
OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)
TOLERANCE = 1e-9


def _checked() -> list[MethodEntry]:
    return [e for e in ENTRIES if e.opt_out("ddp_equals_one_process") is None]


def _fit(entry: MethodEntry, batch_size: int, world: int, order: list[int] | None = None
         ) -> dict[str, Tensor]:
    pl.seed_everything(0, verbose=False)
    model = entry.small(**OPTIM)
    data: Any = KeyedViews(SAMPLES, entry.views)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        precision="64-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=TensorDataModule(
        data if order is None else Subset(data, order), batch_size))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    """Every checked method on this rank of the pool's process group (Lightning joins it)."""
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    return {entry.name: _fit(entry, BATCH, world) for entry in _checked()}


def make_runs() -> tuple[list[dict], dict]:
    """The 2-process runs (one pool job) and the 1-process runs in the sampler's order."""
    ranks = run_in_processes(_worker, WORLD)
    order = ddp_global_order(SAMPLES, WORLD, BATCH, sampler_order=True)
    return ranks, {e.name: _fit(e, WORLD * BATCH, 1, order) for e in _checked()}


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_two_processes_equal_one_process_in_sampler_order(entry: MethodEntry, runs) -> None:
    skip_opted_out(entry, "ddp_equals_one_process")
    ranks, single = runs
    for rank, state in enumerate(ranks):
        problems = state_differences(state[entry.name], single[entry.name], TOLERANCE)
        assert not problems, f"{entry.name}, rank {rank}: {problems}"
