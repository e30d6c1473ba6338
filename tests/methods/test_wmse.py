"""W-MSE (Ermolov et al., ICML 2021): bad settings are refused in ``__init__`` with a ValueError
naming the value; a global batch its whitening size does not divide is refused before training."""

from __future__ import annotations

from typing import Any

import pytest

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import WMSE


def _wmse(**kw: Any) -> WMSE:
    return WMSE(SmallConvNet((4, 8)), **{"projection_hidden_dim": 16, "projection_dim": 8,
                                         "whitening_size": 16, **kw})


#: Bad settings and the message each must raise.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"whitening_size": 8}, "whitening_size=8 must exceed projection_dim=8"),
    ({"whitening_iters": 0}, "whitening_iters must be >= 1, got 0"),
    ({"whitening_eps": 1.0}, r"eps must be in \[0, 1\), got 1.0"),
]


def test_bad_settings_are_refused_in_init() -> None:
    for settings, message in BAD:
        with pytest.raises(ValueError, match=message):
            _wmse(**settings)


def test_wmse_refuses_a_global_batch_its_whitening_size_does_not_divide() -> None:
    from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule, fit_and_dump

    with pytest.raises(ValueError, match="whitening_size=16 must divide the global batch "
                                         r"\(batch_size=24 x 1 process"):
        fit_and_dump(_wmse(optimizer="sgd"), TensorDataModule(PrecomputedViews(48), 24),
                     max_steps=1)
