"""The public checks of :mod:`ssl_lightning.testing` pass on a registered method and fail,
naming what differs, on a known-bad user method of each kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import SSLMethod
from ssl_lightning.methods.registry import method_entries
from ssl_lightning.testing import (
    KeyedViews,
    PrecomputedViews,
    TensorDataModule,
    ViewsDataModule,
    assert_micro_batches_equal_whole_batch,
    assert_resume_is_exact,
    assert_two_processes_equal_one,
)
from ssl_lightning.testing.trainer_runs import fit_and_dump

SIMCLR = next(e for e in method_entries() if e.name == "simclr")
OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)


#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


class Aligned(SSLMethod):
    """A user's method: the two views' projections pulled together, the batch's mean
    projection pushed to zero; ``flaw`` makes it break one property."""

    def __init__(self, backbone: nn.Module, flaw: str = "", **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.head = nn.Linear(self.feature_dim, 8)
        self.flaw = flaw
        self.steps_seen = 0  # "resume": algorithm state kept outside the checkpoint

    def forward_views(self, views: list[Tensor]) -> dict[str, Any]:
        features = self.backbone(views[0])
        z1, z2 = self.head(features), self.head(self.backbone(views[1]))
        if self.flaw == "micro":  # one random scale per forward call: per micro-batch
            z1 = z1 * (1 + torch.rand((), dtype=z1.dtype))
        return {"z1": z1, "z2": z2, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2 = outputs["z1"], outputs["z2"]
        mean = z1 if self.flaw == "ddp" else self.gather(z1)  # "ddp": this rank's mean only
        loss = (z1 - z2).pow(2).sum(1).mean() + mean.mean(0).pow(2).sum()
        if self.flaw == "resume":
            self.steps_seen += 1
            loss = loss * self.steps_seen
        return loss


def make_simclr(**kwargs: Any) -> SSLMethod:
    return SIMCLR.small(**OPTIM, **kwargs)


def make_aligned(flaw: str = "", **kwargs: Any) -> SSLMethod:
    return Aligned(SmallConvNet(widths=(4, 8)), flaw=flaw, **OPTIM, **kwargs)


def make_ddp_flawed() -> SSLMethod:
    return make_aligned("ddp")


def _data(seeded: bool = True) -> TensorDataModule:
    return TensorDataModule((KeyedViews if seeded else PrecomputedViews)(16, SIMCLR.views), 8)


def test_micro_batches_pass_on_a_registered_method_with_data_module_or_batches() -> None:
    assert_micro_batches_equal_whole_batch(make_simclr, _data())
    assert_micro_batches_equal_whole_batch(make_aligned, list(_data(False).train_dataloader()))


def test_micro_batches_fail_on_randomness_per_micro_batch() -> None:
    with pytest.raises(AssertionError, match=r"micro_batch_size=2 differs.*\n  (model|loss)"):
        assert_micro_batches_equal_whole_batch(
            lambda **kwargs: make_aligned("micro", **kwargs), _data())


def _resumable() -> ViewsDataModule:
    return ViewsDataModule(PrecomputedViews(16, SIMCLR.views), batch_size=4)


def test_resume_inside_epochs_passes_on_a_registered_method(tmp_path: Path) -> None:
    assert_resume_is_exact(make_simclr, _resumable(), str(tmp_path))  # after steps 1 and 5


def test_resume_fails_on_state_outside_the_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"resumed run differs(.|\n)*"
                       r"resumed after step 1 of 8 \(epoch 0\):\n  (model|optimizer)"):
        assert_resume_is_exact(lambda: make_aligned("resume"), _resumable(), str(tmp_path))


def test_resume_inside_an_epoch_fails_on_a_loader_that_restarts_the_epoch(
        tmp_path: Path) -> None:
    """A plain loader (no position in the checkpoint) resumed after step 1 of its epoch sees
    the epoch's first batch again; at the end of an epoch it resumes exactly."""
    data = TensorDataModule(PrecomputedViews(16, SIMCLR.views), 4)
    with pytest.raises(AssertionError, match=r"resumed after step 1 of 8"):
        assert_resume_is_exact(make_simclr, data, str(tmp_path / "mid"), stop_steps=(1,))
    assert_resume_is_exact(make_simclr, data, str(tmp_path / "end"), stop_steps=(4,))


def test_resume_refuses_stop_steps_outside_the_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"stop_steps must be steps in \[1, 8\)"):
        assert_resume_is_exact(make_simclr, _resumable(), str(tmp_path), stop_steps=(8,))


@pytest.mark.slow
def test_two_processes_equal_one_passes_and_names_the_method_using_rank_statistics() -> None:
    """One pool job: the registered method and a loss on this rank's batch mean only."""
    with pytest.raises(AssertionError) as caught:
        assert_two_processes_equal_one([make_simclr, make_aligned, make_ddp_flawed],
                                       KeyedViews(24, SIMCLR.views))
    message = str(caught.value)
    assert "make_ddp_flawed, rank 0" in message and "make_ddp_flawed, rank 1" in message
    assert "make_simclr" not in message and "make_aligned," not in message
    assert "head.weight: " in message


class WorkerLoaderData(TensorDataModule):
    """A data module whose train loader starts a DataLoader worker."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, num_workers=1)


@pytest.mark.slow
def test_fit_and_dump_on_two_processes_names_num_workers_when_a_loader_starts_workers() -> None:
    """The pool's daemon processes cannot start loader workers; the error says what to do."""
    with pytest.raises(RuntimeError, match="give the data module num_workers=0"):
        fit_and_dump(make_simclr(), WorkerLoaderData(KeyedViews(8, SIMCLR.views), 2), devices=2,
                     max_steps=1)
