"""Property of every registered method: ``Method.load_from_checkpoint(path)`` with no
arguments rebuilds what a Trainer saved.

For each method of the registry, its small instance takes one Trainer step with a
``ModelCheckpoint`` (the CLI's way of saving: ``last.ckpt``). ``Class.load_from_checkpoint``
of that file, given nothing but the path, returns an instance of the class (the backbone, and a
distillation teacher, rebuilt from their recorded specs) whose state_dict equals, key for key
and bit for bit, the trained module's. A method that opts out of ``load_from_checkpoint`` is
skipped with its reason printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from opt_outs import skip_opted_out
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.methods.registry import MethodEntry, method_entries
from ssl_lightning.testing.trainer_runs import (
    entry_data,
    fit_and_dump,
)

ENTRIES = method_entries()
OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)

#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_load_from_checkpoint_with_no_arguments_gives_the_saved_state(entry: MethodEntry,
                                                                      tmp_path: Path) -> None:
    skip_opted_out(entry, "load_from_checkpoint")
    torch.manual_seed(0)
    data = entry_data(entry, 8, 8)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    (trained,) = fit_and_dump(entry.small(**OPTIM), data, callbacks=[saver], max_steps=1,
                              enable_checkpointing=True)
    loaded = entry.cls.load_from_checkpoint(str(tmp_path / "last.ckpt"))
    assert type(loaded) is entry.cls
    state, expected = loaded.state_dict(), trained["model"]
    assert state.keys() == expected.keys(), set(state) ^ set(expected)
    for key, value in state.items():  # backbone, heads, teachers, queues and banks alike
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
