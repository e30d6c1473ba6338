"""Exact resume of LeJEPA, TiCo, MMCR, W-MSE and VIbCReg: a 2-epoch run and the same run
resumed from its epoch-0 checkpoint by a differently initialised model end with identical
weights and buffers (Lightning Trainer, CPU, fixed views). What each method carries across the
restart: LeJEPA's SIGReg directions and W-MSE's sub-batches (from the saved ``rng_seed``, epoch
and batch index), VIbCReg's IterNorm running statistics (buffers), TiCo's running covariance (a
persistent buffer; the known-bad variant that keeps it out of the checkpoint, as lightly's plain
attribute does, resumes with C = 0 and ends elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import pytorch_lightning as pl
from momentum_utils import fit_and_resume, views_loader

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import TiCoLoss
from ssl_lightning.methods import MMCR, WMSE, LeJEPA, TiCo, VIbCReg

pytestmark = pytest.mark.slow


class _UnsavedCovarianceTiCo(TiCo):
    """Known-bad: the running covariance is not in the checkpoint."""

    def build_criterion(self) -> TiCoLoss:
        criterion = super().build_criterion()
        criterion._non_persistent_buffers_set.add("covariance")
        return criterion


def _tico(cls: type[TiCo] = TiCo) -> pl.LightningModule:
    return cls(SmallConvNet((4, 8)), projection_hidden_dim=16, projection_dim=8,
               momentum_base=0.9, **OPTIM)


OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0.5)

MODELS: dict[str, tuple[Callable[[], pl.LightningModule], int]] = {
    "lejepa": (lambda: LeJEPA(SmallConvNet((4, 8)), projection_hidden_dim=16, projection_dim=8,
                              num_slices=16, **OPTIM), 3),
    "tico": (_tico, 2),
    "mmcr": (lambda: MMCR(SmallConvNet((4, 8)), projection_hidden_dim=16, projection_dim=8,
                          **OPTIM), 3),
    "wmse": (lambda: WMSE(SmallConvNet((4, 8)), projection_hidden_dim=16, projection_dim=3,
                          whitening_size=4, whitening_iters=2, **OPTIM), 2),
    "vibcreg": (lambda: VIbCReg(SmallConvNet((4, 8)), expander_hidden_dim=16, expander_dim=8,
                                iternorm_groups=2, **OPTIM), 2),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_resume_equals_uninterrupted_run(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    make, views = MODELS[name]
    full, resumed = fit_and_resume(
        make, lambda: views_loader(n=8, batch_size=4, num_views=views, size=8), str(tmp_path))
    assert full.keys() == resumed.keys()
    for key, value in full.items():
        assert (resumed[key] == value).all(), key


def test_tico_without_its_covariance_in_the_checkpoint_does_not_resume(tmp_path) -> None:  # type: ignore[no-untyped-def]
    full, resumed = fit_and_resume(
        lambda: _tico(_UnsavedCovarianceTiCo), lambda: views_loader(n=8, batch_size=4, size=8),
        str(tmp_path))
    assert "criterion.covariance" not in full
    assert any(not (resumed[key] == value).all() for key, value in full.items())
