"""Exact resume. Fitting 2 epochs in one go and fitting the same 2-epoch run
that is stopped after epoch 1 and resumed from its last.ckpt end in identical weights, LARS
state, LR-scheduler state and online-probe state (CPU, deterministic precomputed views)."""

from __future__ import annotations

import os

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.callbacks import KNNCallback, OnlineProbe
from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import (
    PrecomputedViews,
    TensorDataModule,
    assert_states_close,
    fit_and_dump,
)

pytestmark = pytest.mark.slow


class _StopAfterEpoch(pl.Callback):
    """Simulates an interrupted run: the 2-epoch job stops when epoch ``epoch`` ends."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 == self.epoch:
            trainer.should_stop = True


def _model() -> SimCLR:
    torch.manual_seed(0)
    # LARS, warm-up that crosses the epoch boundary, a BatchNorm projector (running stats are
    # state too): everything that must come back from the checkpoint.
    return SimCLR(SmallConvNet(widths=(8, 16)), projection_hidden_dim=16, projection_dim=8,
                  head_batch_norm=True, optimizer="lars", lr=2.0, weight_decay=1e-4,
                  warmup_epochs=1.5, final_lr_ratio=0.01)


def _data() -> TensorDataModule:
    g = torch.Generator().manual_seed(1)
    val = [TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(4, (n,), generator=g))
           for n in (12, 8)]
    return TensorDataModule(PrecomputedViews(16), batch_size=4, val=val)


def _callbacks() -> list[pl.Callback]:
    return [OnlineProbe(num_classes=4, lr=0.2), KNNCallback(k=3)]


def test_stop_after_epoch_1_and_resume_equals_uninterrupted_run(tmp_path) -> None:
    straight = fit_and_dump(_model(), _data(), max_epochs=2, callbacks=_callbacks())[0]

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = fit_and_dump(_model(), _data(), max_epochs=2, enable_checkpointing=True,
                         callbacks=[*_callbacks(), checkpoint, _StopAfterEpoch(1)])[0]
    assert first["global_step"] == 4
    resumed = fit_and_dump(_model(), _data(), max_epochs=2, callbacks=_callbacks(),
                           ckpt_path=os.path.join(tmp_path, "last.ckpt"))[0]

    assert straight["global_step"] == resumed["global_step"] == 8
    # The second epoch changed everything, so equality below is not the trivial one.
    assert (straight["model"]["projector.mlp.0.weight"]
            - first["model"]["projector.mlp.0.weight"]).abs().max() > 1e-4
    for part in ("model", "optimizer", "scheduler"):
        assert_states_close(resumed[part], straight[part], atol=0.0, path=part)
    assert_states_close(resumed["callbacks"]["OnlineProbe"], straight["callbacks"]["OnlineProbe"],
                        atol=0.0, path="probe")
    assert resumed["metrics"]["val/knn_top1"] == straight["metrics"]["val/knn_top1"]
