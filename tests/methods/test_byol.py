"""BYOL (Grill et al. 2020) as a Lightning module: its own EMA callback, exact resume, the
momentum check, and the paper's pairing L(p1, z2') + L(p2, z1')."""

from __future__ import annotations

import pytest
import torch
from momentum_utils import (
    COMMON,
    assert_own_ema_callback_and_frozen_teacher,
    assert_resume_is_exact,
    loss_predictions_and_targets,
)

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import BYOL


def _byol() -> BYOL:
    return BYOL(SmallConvNet((8, 16)), momentum_base=0.9, **COMMON)


def test_method_supplies_its_ema_callback_and_frozen_teacher() -> None:
    assert_own_ema_callback_and_frozen_teacher(_byol(), "cosine")


def test_invalid_momentum_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="1.5"):
        BYOL(SmallConvNet((8, 16)), momentum_base=1.5, image_size=8)


def test_resume_is_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert_resume_is_exact(_byol, str(tmp_path))


def test_each_prediction_is_paired_with_the_other_views_target() -> None:
    """L(p1, z2') + L(p2, z1') (a swap of the views would still give a valid-looking loss)."""
    views = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    model = _byol().train()
    loss, (p1, p2), (z1, z2) = loss_predictions_and_targets(model, views)
    expected = model.criterion(p1, p2, z1, z2)
    swapped = model.criterion(p1, p2, z2, z1)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(swapped, expected, atol=1e-3)
