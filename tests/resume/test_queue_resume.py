"""Exact resume of every queue and support set: MoCo v2+ (one queue per view), NNSiam, NNBYOL,
All4One and NNCLR (support sets), ReSSL (teacher keys) and NT-Xent's memory bank. A 2-epoch run
and the same run stopped after epoch 1 and resumed from its last.ckpt end with identical weights,
teachers, optimizer state, queue contents and pointers (Lightning Trainer, CPU, precomputed
views; the queues wrap around in epoch 2). SupCon trains through the same run on the dataset's
targets (the path ``training_step`` gives them)."""

from __future__ import annotations

import os

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import NNBYOL, NNCLR, All4One, MoCoV2Plus, NNSiam, ReSSL, SimCLR, SupCon
from ssl_lightning.testing.trainer_runs import (
    PrecomputedViews,
    TensorDataModule,
    assert_states_close,
    fit_and_dump,
)

pytestmark = pytest.mark.slow


class _StopAfterEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.should_stop = True


def _model(name: str) -> pl.LightningModule:
    torch.manual_seed(0)
    common = dict(projection_hidden_dim=16, projection_dim=8, queue_size=12, optimizer="sgd",
                  lr=0.5, warmup_epochs=0.5)
    backbone = SmallConvNet(widths=(4, 8))
    if name == "moco_v2_plus":
        return MoCoV2Plus(backbone, **common)
    if name == "nnsiam":
        return NNSiam(backbone, predictor_hidden_dim=8, **common)
    if name == "ressl":
        return ReSSL(backbone, **common)
    if name == "all4one":
        return All4One(backbone, predictor_hidden_dim=8, neighbours=3, transformer_layers=1,
                       transformer_heads=2, **common)
    return NNBYOL(backbone, **common)


def _data() -> TensorDataModule:
    return TensorDataModule(PrecomputedViews(8), batch_size=4)


@pytest.mark.parametrize("name", ["moco_v2_plus", "nnsiam", "nnbyol", "ressl", "all4one"])
def test_stop_and_resume_equals_uninterrupted_run(name: str, tmp_path) -> None:
    straight = fit_and_dump(_model(name), _data(), max_epochs=2)[0]
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = fit_and_dump(_model(name), _data(), max_epochs=2, enable_checkpointing=True,
                         callbacks=[checkpoint, _StopAfterEpoch()])[0]
    assert first["global_step"] == 2
    resumed = fit_and_dump(_model(name), _data(), max_epochs=2,
                           ckpt_path=os.path.join(tmp_path, "last.ckpt"))[0]
    assert straight["global_step"] == resumed["global_step"] == 4
    queues = [k for k in straight["model"] if k.endswith("queue")]
    assert len(queues) == (2 if name == "moco_v2_plus" else 1)
    for key in queues:  # epoch 2 rewrote the queue, so equality below is not the trivial one
        assert not torch.equal(first["model"][key], straight["model"][key])
        assert int(straight["model"][key + "_ptr"]) == 16 % 12
    for part in ("model", "optimizer", "scheduler"):
        assert_states_close(resumed[part], straight[part], atol=0.0, path=part)


def _contrastive_model(name: str) -> pl.LightningModule:
    torch.manual_seed(0)
    backbone = SmallConvNet(widths=(4, 8))
    common = dict(projection_hidden_dim=16, projection_dim=8, optimizer="sgd", lr=0.5,
                  warmup_epochs=0.5)
    if name == "nnclr":  # 2 steps per epoch of 4 -> the queue wraps around in epoch 2
        return NNCLR(backbone, predictor_hidden_dim=16, queue_size=12, **common)
    if name == "supcon":
        return SupCon(backbone, **common)
    return SimCLR(backbone, queue_size=12, margin=0.1, **common)


def _labelled_data() -> TensorDataModule:
    return TensorDataModule(PrecomputedViews(8, num_classes=3), batch_size=4)


@pytest.mark.parametrize("name", ["nnclr", "simclr_bank", "supcon"])
def test_contrastive_stop_and_resume_equals_uninterrupted_run(name: str, tmp_path) -> None:
    straight = fit_and_dump(_contrastive_model(name), _labelled_data(), max_epochs=2)[0]
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = fit_and_dump(_contrastive_model(name), _labelled_data(), max_epochs=2,
                         enable_checkpointing=True, callbacks=[checkpoint, _StopAfterEpoch()])[0]
    assert first["global_step"] == 2
    resumed = fit_and_dump(_contrastive_model(name), _labelled_data(), max_epochs=2,
                           ckpt_path=os.path.join(tmp_path, "last.ckpt"))[0]
    assert straight["global_step"] == resumed["global_step"] == 4
    queues = [k for k in straight["model"] if k.endswith("queue")]
    assert len(queues) == (0 if name == "supcon" else 1)
    for key in queues:  # epoch 2 rewrote the queue, so equality below is not the trivial one
        assert not torch.equal(first["model"][key], straight["model"][key])
        assert int(straight["model"][key + "_ptr"]) == 16 % 12
    for part in ("model", "optimizer", "scheduler"):
        assert_states_close(resumed[part], straight[part], atol=0.0, path=part)
