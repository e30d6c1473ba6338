"""TiCo (Zhu et al. 2022): bad settings are refused in ``__init__`` with a ValueError naming the
value."""

from __future__ import annotations

from typing import Any

import pytest

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import TiCo


def _tico(**kw: Any) -> TiCo:
    return TiCo(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8, **kw})


#: Bad settings and the message each must raise.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"beta": 1.5}, r"beta must be in \[0, 1\), got 1.5"),
    ({"rho": -8.0}, "rho must be >= 0, got -8.0"),
    ({"momentum_base": 1.5}, "1.5"),
]


def test_bad_settings_are_refused_in_init() -> None:
    for settings, message in BAD:
        with pytest.raises(ValueError, match=message):
            _tico(**settings)
