"""Property of every registered method: micro-batches equal the whole batch.

For each method of the registry (:func:`ssl_lightning.methods.registry.method_entries`), its
small instance trains 3 optimizer steps through the Trainer in float64 on whole batches of 8
and with ``micro_batch_size=2``, both on batches that carry sample seeds (the data modules') and
on ``(views, targets)`` batches (a user's own data module); the weights, buffers (queues,
centres, teachers), logged losses and step features agree to 1e-10 relative. A method that opts
out of a property (:attr:`MethodEntry.opt_outs`) is skipped with its reason printed.

Naive accumulation (``accumulate_grad_batches=4`` on batches of 2, the loss per micro-batch)
changes the weights of every batch-coupled method and warns once; for a method whose loss is a
mean of per-sample terms it is silent. The mechanism's own checks (drop-path replay, BatchNorm
statistics, loss scale, DDP, resume, bad input) are in ``tests/training/test_grad_cache.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from opt_outs import skip_opted_out
from torch import Tensor

from ssl_lightning.methods.registry import MethodEntry, method_entries
from ssl_lightning.testing.trainer_runs import (
    KeyedViews,
    PrecomputedViews,
    TensorDataModule,
    fit_and_dump,
    max_relative_difference,
)

OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
ENTRIES = method_entries()
#: Micro-batches = whole batch is an exactness check, so it runs in float64 (Lightning's 64-true
#: converts the model and the batches): the runs then differ only by float64 summation order
#: (~1e-14). In fp32 the changed summation order alone (1e-7 per operation, different for each
#: CPU kernel set and thread count) reaches 1.6e-6 (MoCo v3 on AVX-512) to 2e-5 (SwAV's
#: Sinkhorn) in the weights after 3 steps.
TOLERANCE = 1e-10
SEEDS = {"sample_seeds": True, "no_seeds": False}


#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


class RecordSteps(pl.Callback):
    """The ``training_step`` outputs' features and the loss of every step."""

    def __init__(self) -> None:
        self.features: list[Tensor] = []
        self.losses: list[Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.features.append(outputs["features"].clone())
        self.losses.append(outputs["loss"].detach().clone())


def fit(entry: MethodEntry, seeded: bool, batch_size: int, micro: int | None,
        **trainer_kwargs: Any) -> dict:
    """3 float64 steps of ``entry``'s small instance on 24 samples; the final states plus the
    steps' features and losses."""
    torch.manual_seed(0)
    model = entry.small(micro_batch_size=micro, **OPTIM)
    recorder = RecordSteps()
    data = (KeyedViews if seeded else PrecomputedViews)(24, entry.views)
    state = fit_and_dump(model, TensorDataModule(data, batch_size), callbacks=[recorder],
                         max_steps=3, precision="64-true", **trainer_kwargs)[0]
    return {**state, "features": recorder.features, "losses": recorder.losses}


@pytest.fixture(scope="module")
def whole_batch() -> dict[tuple[str, bool], dict]:
    """Whole-batch (8 samples, 3 steps) reference runs, made on first use."""
    return {}


def reference(runs: dict[tuple[str, bool], dict], entry: MethodEntry, seeded: bool) -> dict:
    if (entry.name, seeded) not in runs:
        runs[entry.name, seeded] = fit(entry, seeded, 8, None)
    return runs[entry.name, seeded]


@pytest.mark.parametrize("seeded", list(SEEDS.values()), ids=list(SEEDS))
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_micro_batches_equal_the_whole_batch(entry: MethodEntry, seeded: bool,
                                             whole_batch: dict) -> None:
    skip_opted_out(entry, "micro_batching" if seeded else "micro_batching_seedless")
    expected = reference(whole_batch, entry, seeded)
    actual = fit(entry, seeded, 8, 2)
    assert actual["global_step"] == expected["global_step"] == 3
    difference = max_relative_difference(actual["model"], expected["model"])
    assert difference < TOLERANCE, f"{entry.name}: weights differ by {difference:.3g} (relative)"
    for got, want in zip(actual["features"], expected["features"], strict=True):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(torch.stack(actual["losses"]), torch.stack(expected["losses"]),
                               rtol=TOLERANCE, atol=0)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.needs_sample_seeds],
                         ids=[e.name for e in ENTRIES if e.needs_sample_seeds])
def test_methods_that_need_sample_seeds_refuse_batches_without_them(entry: MethodEntry) -> None:
    """What their ``micro_batching_seedless`` opt-out says: no step on seedless batches."""
    with pytest.raises(ValueError, match="sample_seeds"):
        fit(entry, False, 8, None)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_naive_accumulation_changes_coupled_losses_and_warns(entry: MethodEntry,
                                                             whole_batch: dict) -> None:
    seeded = entry.needs_sample_seeds  # batches without seeds where the method allows them
    if entry.small().min_global_batch > 2:  # e.g. W-MSE: one whitening sub-batch of 4
        with pytest.raises(ValueError, match="global batch"):
            fit(entry, seeded, 2, None, accumulate_grad_batches=4)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        naive = fit(entry, seeded, 2, None, accumulate_grad_batches=4)
    warned = [w for w in caught if "micro_batch_size" in str(w.message)]
    difference = max_relative_difference(naive["model"],
                                          reference(whole_batch, entry, seeded)["model"])
    if entry.cls.batch_coupled_loss:
        assert len(warned) == 1 and "accumulate_grad_batches=4" in str(warned[0].message)
        assert difference > 1e-4
    else:
        assert not warned
    if entry.name in ("byol", "simsiam"):  # means of per-sample terms: plain accumulation is exact
        assert difference < 1e-6
