"""SimCLR trained by Lightning with 2 CPU processes (DDP, gloo) ends with
the same parameters as one process trained on the doubled batch.

The same run checks the evaluation callbacks under DDP: the online probe (trained on gathered
features) ends identical on both ranks and equal to the single-process probe, and the kNN and
probe accuracies on validation sets of odd size (so DistributedSampler pads them with
duplicates) equal the single-process values.
"""

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import Subset, TensorDataset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.callbacks import KNNCallback, OnlineProbe
from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import (
    PrecomputedViews,
    TensorDataModule,
    assert_states_close,
    ddp_global_order,
    fit_and_dump,
)

pytestmark = pytest.mark.slow

BATCH, STEPS, SAMPLES = 4, 3, 24


def _model() -> SimCLR:
    pl.seed_everything(0)
    return SimCLR(
        SmallConvNet(widths=(8, 16), norm="group"), projection_hidden_dim=16, projection_dim=8,
        head_batch_norm=False, temperature=0.2, optimizer="sgd", lr=0.5,
        lr_scaling="linear", weight_decay=1e-4, warmup_epochs=0,
    )


def _val_sets() -> list[TensorDataset]:
    g = torch.Generator().manual_seed(5)
    return [TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(4, (n,), generator=g))
            for n in (13, 7)]  # kNN bank, queries: odd sizes -> padded under 2 ranks


def _callbacks() -> list:
    return [KNNCallback(k=5, temperature=0.1), OnlineProbe(num_classes=4, lr=0.5)]


def test_two_process_fit_equals_single_process_with_doubled_batch() -> None:
    data = PrecomputedViews(SAMPLES)
    ddp = fit_and_dump(_model(), TensorDataModule(data, BATCH, _val_sets(), 3), devices=2,
                       max_epochs=1, callbacks=_callbacks())
    order = ddp_global_order(SAMPLES, 2, BATCH)
    single_data = TensorDataModule(Subset(data, order), 2 * BATCH, _val_sets(), 3)
    single = fit_and_dump(_model(), single_data, devices=1, max_epochs=1, callbacks=_callbacks())
    initial = _model().state_dict()
    assert ddp[0]["global_step"] == single[0]["global_step"] == STEPS
    # Training moved the weights well beyond the tolerance, so equality is not vacuous.
    moved = max((single[0]["model"][k] - initial[k]).abs().max() for k in initial)
    assert moved > 1e-3
    for rank_state in ddp:
        assert_states_close(rank_state["model"], single[0]["model"], atol=1e-6)
        assert_states_close(rank_state["optimizer"], single[0]["optimizer"], atol=1e-6)
        assert_states_close(rank_state["scheduler"], single[0]["scheduler"], atol=1e-9)
        assert_states_close(rank_state["callbacks"]["OnlineProbe"],
                            single[0]["callbacks"]["OnlineProbe"], atol=1e-5)
        for metric in ("val/knn_top1", "val/knn_top5", "val/probe_top1"):
            assert rank_state["metrics"][metric] == single[0]["metrics"][metric], metric
    # Every rank made the identical probe update from the gathered global batch.
    assert_states_close(ddp[1]["callbacks"]["OnlineProbe"], ddp[0]["callbacks"]["OnlineProbe"],
                        atol=0)
