"""LeJEPA, TiCo, MMCR, W-MSE and VIbCReg refuse bad settings in ``__init__`` with a
ValueError naming the value, and too few views at the first step; the step's outputs have the
shapes the loss and the callbacks expect."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MMCR, WMSE, LeJEPA, SSLMethod, TiCo, VIbCReg


def _lejepa(**kw: Any) -> LeJEPA:
    return LeJEPA(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8,
                                           "num_slices": 8, **kw})


def _tico(**kw: Any) -> TiCo:
    return TiCo(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8, **kw})


def _mmcr(**kw: Any) -> MMCR:
    return MMCR(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8, **kw})


def _wmse(**kw: Any) -> WMSE:
    return WMSE(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8,
                                         "whitening_size": 16, **kw})


def _vibcreg(**kw: Any) -> VIbCReg:
    return VIbCReg(SmallConvNet((4, 8)), **{"expander_hidden_dim": 16, "expander_dim": 8,
                                                "iternorm_groups": 2, **kw})


#: name -> (factory, bad settings and the message each must raise)
BAD: dict[str, tuple[Callable[..., SSLMethod], list[tuple[dict[str, Any], str]]]] = {
    "lejepa": (_lejepa, [
        ({"lambda_sigreg": -0.1}, r"lambda_sigreg must be in \[0, 1\], got -0.1"),
        ({"num_slices": 0}, "num_slices must be >= 1, got 0"),
        ({"sigreg_knots": 1}, "knots must be >= 2, got 1"),
        ({"sigreg_t_max": -3.0}, "t_max must be > 0, got -3.0"),
        ({"num_global_views": 0}, "num_global_views must be >= 1, got 0"),
    ]),
    "tico": (_tico, [
        ({"beta": 1.5}, r"beta must be in \[0, 1\), got 1.5"),
        ({"rho": -8.0}, "rho must be >= 0, got -8.0"),
        ({"momentum_base": 1.5}, "1.5"),
    ]),
    "mmcr": (_mmcr, [({"lambda_views": -0.5}, "lambda_views must be >= 0, got -0.5")]),
    "wmse": (_wmse, [
        ({"whitening_size": 8}, "whitening_size=8 must exceed projection_dim=8"),
        ({"whitening_iters": 0}, "whitening_iters must be >= 1, got 0"),
        ({"whitening_eps": 1.0}, r"eps must be in \[0, 1\), got 1.0"),
    ]),
    "vibcreg": (_vibcreg, [
        ({"iternorm_groups": 3}, "iternorm_groups=3 must be >= 1 and divide expander_dim=8"),
        ({"iternorm_iterations": 0}, "iternorm_iterations must be >= 1, got 0"),
        ({"covariance_weight": -200.0}, "covariance_weight must be >= 0, got -200.0"),
    ]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_settings_are_refused_in_init(name: str) -> None:
    make, cases = BAD[name]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            make(**settings)


def test_lejepa_needs_its_global_views_and_uses_every_crop() -> None:
    model = _lejepa(num_global_views=3)
    with pytest.raises(ValueError, match="LeJEPA needs 3 views per sample, got 2"):
        model.training_loss([torch.randn(4, 3, 8, 8)] * 2)
    views = [torch.randn(4, 3, 8, 8)] * 3 + [torch.randn(4, 3, 4, 4)] * 2
    outputs = model.forward_views(views)
    assert outputs["z"].shape == (4, 5, 8) and outputs["features"].shape == (4, 8)
    torch.testing.assert_close(outputs["features"], model.backbone(views[0]))


def test_wmse_refuses_a_global_batch_its_whitening_size_does_not_divide() -> None:
    from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule, fit_and_dump

    with pytest.raises(ValueError, match="whitening_size=16 must divide the global batch "
                                         r"\(batch_size=24 x 1 process"):
        fit_and_dump(_wmse(optimizer="sgd"), TensorDataModule(PrecomputedViews(48), 24),
                     max_steps=1)
