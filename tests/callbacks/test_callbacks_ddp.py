"""Callbacks whose collectives are subtle, on 2 processes (DDP, gloo) vs 1 process.

- ``LinearEval`` logs its accuracies at epoch end, where rank 0's progress bar already reduces
  the epoch metrics: a collective of its own there (a torchmetrics ``compute``) hung. Its
  metrics must equal those of one process holding the global batch, with the
  ``DistributedSampler`` padding of an odd val split dropped.
- ``EmbeddingPlot`` reads ``trainer.log_dir`` (a broadcast) on every rank and draws on rank 0;
  ``CollapseMonitor`` gathers the val embeddings (without the padding) and must log the values
  of one process.
- Divergence: a finite loss whose update overflows stops the run after that step, and a
  checkpoint of non-finite weights is refused.
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import pytorch_lightning as pl
import torch
from evaluation_helpers import tiny_trainer
from torch.utils.data import DataLoader, Subset, TensorDataset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.callbacks import CollapseMonitor
from ssl_lightning.evaluation import EmbeddingPlot, LinearEval
from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import (
    PrecomputedViews,
    TensorDataModule,
    ddp_global_order,
    fit_and_dump,
)
from ssl_lightning.training.divergence import TrainingDivergedError

pytestmark = pytest.mark.slow

pytest.importorskip("matplotlib")

METRICS = ("train/loss_epoch", "train/top1", "val/loss", "val/top1", "val/top5",
           "val/embedding_std", "val/rankme")


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    targets = torch.arange(n) % 3
    colours = torch.tensor([[1.5, 0, 0], [0, 1.5, 0], [0, 0, 1.5]])
    return TensorDataset(colours[targets][:, :, None, None] + torch.randn(n, 3, 8, 8, generator=g),
                         targets)


def _linear_eval() -> LinearEval:
    torch.manual_seed(0)
    return LinearEval(SmallConvNet((8, 16), norm="group"), 3, checkpoint="random", lr=0.5,
                      lr_scaling="none")


def test_linear_eval_embedding_plot_and_collapse_monitor_equal_one_process(tmp_path) -> None:
    train, bank, val = _data(16, 0), _data(12, 1), _data(13, 2)  # 13: padded to 14 on 2 ranks
    runs = {}
    for devices, order, batch in ((2, range(16), 4), (1, ddp_global_order(16, 2, 4), 8)):
        plots = tmp_path / f"plots{devices}"
        runs[devices] = fit_and_dump(
            _linear_eval(), TensorDataModule(Subset(train, list(order)), batch, [bank, val],
                                             val_batch_size=3),
            devices=devices, max_epochs=1,
            callbacks=[EmbeddingPlot(dirpath=str(plots)), CollapseMonitor(min_rankme=1.0)],
        )
        assert len(glob.glob(str(plots / "embeddings_fit_epoch000.png"))) == 1, devices
    single = runs[1][0]["metrics"]
    for rank in (0, 1):
        ddp = runs[2][rank]["metrics"]
        for key in METRICS:
            assert ddp[key] == pytest.approx(single[key], abs=1e-5), (rank, key)
    assert 0 < single["val/top1"] <= single["val/top5"] <= 100


class _InfiniteGradients(pl.Callback):
    """Makes the update of step ``step`` overflow (the loss of that step stays finite)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.backbone.parameters():
                p.grad.fill_(float("inf"))


def _simclr() -> SimCLR:
    return SimCLR(SmallConvNet((8, 16), norm="group"), projection_hidden_dim=16,
                  projection_dim=8, optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)


def test_overflowing_update_stops_after_that_step_and_no_checkpoint_is_written(tmp_path) -> None:
    model = _simclr()
    trainer = tiny_trainer(max_steps=5, callbacks=[_InfiniteGradients(step=2)])
    with pytest.raises(TrainingDivergedError, match=r"weights are not finite.*after global step 3"
                                                    r".*lower learning rate"):
        trainer.fit(model, DataLoader(PrecomputedViews(32), batch_size=4))
    assert trainer.global_step == 3
    path = str(tmp_path / "nan.ckpt")
    with pytest.raises(TrainingDivergedError, match="weights are not finite"):
        trainer.save_checkpoint(path)
    assert not os.path.exists(path)


class _NaNOnRank1(SimCLR):
    """SimCLR whose loss is NaN on rank 1 only, at global step 1; each rank appends the error it
    raises to ``<out_dir>/rank<r>.txt``."""

    out_dir = ""

    def training_loss(self, views):  # type: ignore[no-untyped-def]
        loss, features = super().training_loss(views)
        if self.global_rank == 1 and self.trainer.global_step == 1:
            loss = loss * float("nan")
        return loss, features

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        try:
            return super().training_step(batch, batch_idx)
        except TrainingDivergedError as err:
            with open(os.path.join(self.out_dir, f"rank{self.global_rank}.txt"), "w") as f:
                f.write(f"TrainingDivergedError: {err}")
            raise


def test_nan_loss_on_one_rank_stops_both_ranks_at_that_step(tmp_path) -> None:
    model = _NaNOnRank1(SmallConvNet((8, 16), norm="group"), projection_hidden_dim=16,
                        projection_dim=8, optimizer="sgd", lr=0.1, lr_scaling="none",
                        warmup_epochs=0)
    model.out_dir = str(tmp_path)
    with pytest.raises(Exception, match="TrainingDivergedError"):
        fit_and_dump(model, TensorDataModule(PrecomputedViews(32), 4), devices=2, max_steps=4)
    for rank, value in ((0, r"[0-9.]+"), (1, "nan")):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert re.match(
            rf"TrainingDivergedError: Training diverged: the loss is not finite on 1 of 2 ranks "
            rf"\(rank {rank}: {value}\) at global step 1 \(epoch 0, batch 1\) with learning rate "
            r"[0-9.]+\. The step was not applied", message), message
