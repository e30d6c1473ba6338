"""MoCo v3 (Chen et al. 2021) as a Lightning module: its own EMA callback, exact resume, and
the paper's pairing ctr(q1, k2) + ctr(q2, k1)."""

from __future__ import annotations

import torch
from momentum_utils import (
    COMMON,
    assert_own_ema_callback_and_frozen_teacher,
    assert_resume_is_exact,
    loss_predictions_and_targets,
)

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MoCoV3


def _moco_v3() -> MoCoV3:
    return MoCoV3(SmallConvNet((8, 16)), projection_layers=2, momentum_base=0.9, **COMMON)


def test_method_supplies_its_ema_callback_and_frozen_teacher() -> None:
    assert_own_ema_callback_and_frozen_teacher(_moco_v3(), "cosine")


def test_resume_is_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert_resume_is_exact(_moco_v3, str(tmp_path))


def test_each_query_is_paired_with_the_other_views_key() -> None:
    """ctr(q1, k2) + ctr(q2, k1) (a swap of the views would still give a valid-looking loss)."""
    views = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    model = _moco_v3().train()
    loss, (p1, p2), (z1, z2) = loss_predictions_and_targets(model, views)
    expected = model.criterion(p1, z2) + model.criterion(p2, z1)
    swapped = model.criterion(p1, z1) + model.criterion(p2, z2)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(swapped, expected, atol=1e-3)
