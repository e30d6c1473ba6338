"""LeJEPA (Balestriero & LeCun 2025): bad settings are refused in ``__init__`` with a ValueError
naming the value; too few views are refused at the first step and the step's outputs have the
shapes the loss and the callbacks expect."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import LeJEPA


def _lejepa(**kw: Any) -> LeJEPA:
    return LeJEPA(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8,
                                           "num_slices": 8, **kw})


#: Bad settings and the message each must raise.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"lambda_sigreg": -0.1}, r"lambda_sigreg must be in \[0, 1\], got -0.1"),
    ({"num_slices": 0}, "num_slices must be >= 1, got 0"),
    ({"sigreg_knots": 1}, "knots must be >= 2, got 1"),
    ({"sigreg_t_max": -3.0}, "t_max must be > 0, got -3.0"),
    ({"num_global_views": 0}, "num_global_views must be >= 1, got 0"),
]


def test_bad_settings_are_refused_in_init() -> None:
    for settings, message in BAD:
        with pytest.raises(ValueError, match=message):
            _lejepa(**settings)


def test_lejepa_needs_its_global_views_and_uses_every_crop() -> None:
    model = _lejepa(num_global_views=3)
    with pytest.raises(ValueError, match="LeJEPA needs 3 views per sample, got 2"):
        model.training_loss([torch.randn(4, 3, 8, 8)] * 2)
    views = [torch.randn(4, 3, 8, 8)] * 3 + [torch.randn(4, 3, 4, 4)] * 2
    outputs = model.forward_views(views)
    assert outputs["z"].shape == (4, 5, 8) and outputs["features"].shape == (4, 8)
    torch.testing.assert_close(outputs["features"], model.backbone(views[0]))
