"""MMCR (Yerxa et al. 2023): bad settings are refused in ``__init__`` with a ValueError naming the
value."""

from __future__ import annotations

from typing import Any

import pytest

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MMCR


def _mmcr(**kw: Any) -> MMCR:
    return MMCR(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8, **kw})


#: Bad settings and the message each must raise.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"lambda_views": -0.5}, "lambda_views must be >= 0, got -0.5")
]


def test_bad_settings_are_refused_in_init() -> None:
    for settings, message in BAD:
        with pytest.raises(ValueError, match=message):
            _mmcr(**settings)
