"""Method set-ups that used to run silently wrong (or fail late): a global batch of one for losses
that need the other samples, extra views a 2-view method ignores, SwAV's queue split over the
processes, a queue that the global batch does not divide."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from ssl_lightning import (
    BYOL,
    DINO,
    NNCLR,
    BarlowTwins,
    MoCoV2,
    MoCoV3,
    SimCLR,
    SimSiam,
    SmallConvNet,
    SwAV,
    VICReg,
)
from ssl_lightning.losses import NTXentLoss

SMALL = {"projection_hidden_dim": 8, "projection_dim": 4}
NEEDS_TWO = {
    SimCLR: dict(SMALL, head_batch_norm=False),
    MoCoV3: dict(SMALL, head_batch_norm=False),
    VICReg: {"expander_hidden_dim": 8, "expander_dim": 4, "head_batch_norm": False},
    BarlowTwins: dict(SMALL, head_batch_norm=False),
    SwAV: dict(SMALL, head_batch_norm=False, num_prototypes=5),
}
BATCH_OF_ONE_IS_FINE = {
    BYOL: dict(SMALL, head_batch_norm=False),
    SimSiam: dict(SMALL, head_batch_norm=False, predictor_hidden_dim=4),
    MoCoV2: dict(SMALL, queue_size=8),  # negatives come from the queue
    DINO: {"head_out_dim": 8, "head_hidden_dim": 8, "head_bottleneck_dim": 4},
}


def _with_trainer(model: pl.LightningModule, batch_size: int, world_size: int):
    model._trainer = SimpleNamespace(  # what check_global_batch / setup read
        train_dataloader=SimpleNamespace(batch_size=batch_size), world_size=world_size)
    return model


def test_nt_xent_of_a_single_sample_is_exactly_zero():
    z1, z2 = torch.randn(1, 4), torch.randn(1, 4)  # why SimCLR refuses it: no negatives
    assert NTXentLoss(0.2)(z1, z2).item() == 0.0


@pytest.mark.parametrize("cls", list(NEEDS_TWO))
def test_methods_that_compare_samples_refuse_a_global_batch_of_one(cls):
    model = cls(SmallConvNet((4, 8)), **NEEDS_TWO[cls])
    with pytest.raises(ValueError, match=rf"{cls.__name__} needs a global batch \(batch_size x "
                                         r"processes\) of >= 2, got batch_size=1 x 1 process"):
        _with_trainer(model, 1, 1).check_global_batch()
    _with_trainer(model, 1, 2).check_global_batch()  # the other rank's sample is a negative


@pytest.mark.parametrize("cls", list(BATCH_OF_ONE_IS_FINE))
def test_per_sample_losses_accept_a_batch_of_one(cls):
    model = cls(SmallConvNet((4, 8)), **BATCH_OF_ONE_IS_FINE[cls])
    _with_trainer(model, 1, 1).check_global_batch()


def test_batch_of_one_is_refused_when_fit_starts(tmp_path):
    data = [([torch.rand(3, 8, 8), torch.rand(3, 8, 8)], 0) for _ in range(2)]
    model = SimCLR(SmallConvNet((4, 8)), **NEEDS_TWO[SimCLR])
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="NT-Xent's negatives are the other samples"):
        trainer.fit(model, DataLoader(data, batch_size=1))
    assert trainer.global_step == 0


def _multicrop_batch(batch: int = 2):
    views = [torch.rand(batch, 3, 16, 16) for _ in range(2)]
    return views + [torch.rand(batch, 3, 8, 8) for _ in range(3)], torch.zeros(batch).long()


def _audit_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "views per sample" in str(w.message)]


def test_two_view_method_warns_once_about_ignored_multicrop_views():
    model = SimCLR(SmallConvNet((4, 8)), **NEEDS_TWO[SimCLR])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.training_step(_multicrop_batch(), 0)
        model.training_step(_multicrop_batch(), 1)
    assert _audit_warnings(caught) == [
        "SimCLR uses 2 views per sample, but the train transform makes 5: the other 3 (e.g. the "
        "local crops of MultiCropViews) are computed and ignored. Use a 2-view transform "
        "(SimCLRViews, BYOLViews) or a multi-crop method (DINO, SwAV)."]
    dino = DINO(SmallConvNet((4, 8)), **BATCH_OF_ONE_IS_FINE[DINO])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dino.training_step(_multicrop_batch(), 0)
    assert _audit_warnings(caught) == []  # multi-crop methods use every view


def test_swav_queue_size_is_checked_at_setup():
    model = SwAV(SmallConvNet((4, 8)), queue_size=100, **NEEDS_TWO[SwAV])
    _with_trainer(model, 4, 2).setup("fit")
    model = SwAV(SmallConvNet((4, 8)), queue_size=100, **NEEDS_TWO[SwAV])
    with pytest.raises(ValueError, match=r"SwAV queue_size=100 is not divisible by the 3 "
                                         r"processes .* Use queue_size: 102 or 99\."):
        _with_trainer(model, 4, 3).setup("fit")


@pytest.mark.parametrize(("cls", "kwargs", "queue"), [
    (MoCoV2, dict(SMALL, queue_size=12), "queue"),
    (NNCLR, dict(SMALL, queue_size=12, predictor_hidden_dim=8), "support_set"),
    (SimCLR, dict(SMALL, queue_size=12), "criterion.bank"),
])
def test_a_queue_not_divided_by_the_global_batch_is_refused_when_fit_starts(cls, kwargs, queue):
    """12 = 3 steps of 4 on one process, but not a whole number of steps of 4 x 2 processes
    (before: an error at the first enqueue, after the first forward pass)."""
    _with_trainer(cls(SmallConvNet((8,)), **kwargs), batch_size=4, world_size=1).on_fit_start()
    model = _with_trainer(cls(SmallConvNet((8,)), **kwargs), batch_size=4, world_size=2)
    with pytest.raises(ValueError, match=(
            rf"{cls.__name__}.{queue} holds 12 embeddings, not a multiple of the global batch 8 "
            r"\(batch_size=4 x 2 process\(es\)\).*Use queue_size 8 or 16")):
        model.on_fit_start()
