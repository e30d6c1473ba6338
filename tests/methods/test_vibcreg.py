"""VIbCReg (Lee & Aune 2021): bad settings are refused in ``__init__`` with a ValueError naming the
value."""

from __future__ import annotations

from typing import Any

import pytest

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import VIbCReg


def _vibcreg(**kw: Any) -> VIbCReg:
    return VIbCReg(SmallConvNet((4, 8)), **{"expander_hidden_dim": 16, "expander_dim": 8,
                                                "iternorm_groups": 2, **kw})


#: Bad settings and the message each must raise.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"iternorm_groups": 3}, "iternorm_groups=3 must be >= 1 and divide expander_dim=8"),
    ({"iternorm_iterations": 0}, "iternorm_iterations must be >= 1, got 0"),
    ({"covariance_weight": -200.0}, "covariance_weight must be >= 0, got -200.0"),
]


def test_bad_settings_are_refused_in_init() -> None:
    for settings, message in BAD:
        with pytest.raises(ValueError, match=message):
            _vibcreg(**settings)
