"""Property of every registered method: its checkpoints are plain data and restore its state.

For each method of the registry, its small instance takes 2 Trainer steps with a
``ModelCheckpoint`` saving after each (the periodic files and ``last.ckpt``). Every file
written loads with ``torch.load(weights_only=True)`` (no pickled objects: hyperparameters,
callback states and the backbone spec are plain data), and ``Trainer.fit(ckpt_path=step 1,
weights_only=True)`` on a fresh instance restores, before its next step, the states saved: the
weights, buffers (queues, centres, teachers, banks), optimiser and scheduler states, callback
states and step. A method that opts out of ``checkpoint_weights_only`` is skipped with its
reason printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from opt_outs import skip_opted_out
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.methods.registry import MethodEntry, method_entries
from ssl_lightning.testing.trainer_runs import (
    assert_states_close,
    entry_data,
    fit_and_dump,
    trainer_state,
)

ENTRIES = method_entries()
OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)


#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


class StateAt(pl.Callback):
    """The states of a run at ``step``: as restored before the first step of a resumed run
    (``on_train_start``), or as they are saved (``on_save_checkpoint``)."""

    state: dict

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            self.state = trainer_state(trainer, pl_module)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict) -> None:
        self.on_train_start(trainer, pl_module)


def _comparable(state: dict) -> dict:
    """``state`` without the test's own callbacks (ModelCheckpoint runs only when saving), the
    logged metrics, and the scheduled weight decay (``weight_decay_end``: a function of the
    step that ``SSLMethod.on_before_optimizer_step`` sets before every optimizer step)."""
    callbacks = {k: v for k, v in state["callbacks"].items()
                 if k not in ("ModelCheckpoint", "StateAt")}
    optimizers = [{**o, "param_groups": [
        {k: v for k, v in g.items() if not (k == "weight_decay" and g.get("weight_decay_schedule"))}
        for g in o["param_groups"]]} for o in state["optimizer"]]
    return {**state, "callbacks": callbacks, "metrics": {}, "optimizer": optimizers}


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_checkpoints_load_with_weights_only_and_restore_the_state(entry: MethodEntry,
                                                                  tmp_path: Path) -> None:
    skip_opted_out(entry, "checkpoint_weights_only")
    torch.manual_seed(0)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1,
                            save_last=True)
    saved = StateAt(1)
    fit_and_dump(entry.small(**OPTIM), entry_data(entry, 16, 8), callbacks=[saved, saver],
                 max_steps=2, enable_checkpointing=True)
    written = sorted(tmp_path.glob("*.ckpt"))
    assert len(written) == 3, written  # step=1, step=2 and last
    for path in written:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        assert {"state_dict", "optimizer_states", "hyper_parameters"} <= set(checkpoint), path
    torch.manual_seed(0)  # the same initial weights (Distillation's teacher is not saved)
    restored = StateAt(1)
    (step,) = tmp_path.glob("*step=1.ckpt")
    fit_and_dump(entry.small(**OPTIM), entry_data(entry, 16, 8), callbacks=[restored],
                 max_steps=2, ckpt_path=str(step), weights_only=True)
    assert_states_close(_comparable(restored.state), _comparable(saved.state), atol=0)
