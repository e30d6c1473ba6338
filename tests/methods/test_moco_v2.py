"""MoCo v2 (Chen et al. 2020) as a Lightning module: its own EMA callback, exact resume (queue
and pointer included), the queue size check and the symmetric loss."""

from __future__ import annotations

import pytest
import torch
from momentum_utils import (
    COMMON,
    assert_own_ema_callback_and_frozen_teacher,
    assert_resume_is_exact,
)

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MoCoV2


def _moco_v2(**kwargs) -> MoCoV2:  # type: ignore[no-untyped-def]
    return MoCoV2(SmallConvNet((8, 16)), queue_size=8, momentum_base=0.9, **COMMON, **kwargs)


def test_method_supplies_its_ema_callback_and_frozen_teacher() -> None:
    assert_own_ema_callback_and_frozen_teacher(_moco_v2(), "constant")


def test_resume_is_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    full = assert_resume_is_exact(_moco_v2, str(tmp_path))
    assert int(full["queue.queue_ptr"]) == (8 * 4) % 8
    assert int(full["shuffle_step"]) == 0  # one process: no shuffling


def test_moco_v2_queue_size_must_be_multiple_of_global_batch() -> None:
    model = MoCoV2(SmallConvNet((8, 16)), queue_size=10, **COMMON)
    views = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="queue size 10 .* 4"):
        model.training_loss(views)


def test_moco_v2_symmetric_loss_is_mean_of_both_directions() -> None:
    torch.manual_seed(0)
    model = _moco_v2(symmetric=True)
    views = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    negatives = model.queue.negatives()
    with torch.no_grad():
        q1, q2 = (model.projector(model.backbone(v)) for v in views)
        k1, k2 = (model.teacher_projector(model.teacher_backbone(v)) for v in views)
        expected = (model.criterion(q1, k2, negatives) + model.criterion(q2, k1, negatives)) / 2
    loss, _ = model.training_loss(views)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    # Only the second view's keys were enqueued (one global batch per step).
    torch.testing.assert_close(model.queue.queue[:4], torch.nn.functional.normalize(k2, dim=1),
                               atol=1e-6, rtol=0)
    assert int(model.queue.queue_ptr) == 4
