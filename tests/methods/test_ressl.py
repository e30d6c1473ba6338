"""ReSSL (Zheng et al., NeurIPS 2021) as a module: the teacher sees the second (weak) view and
gets no gradient; a data transform whose weak views differ from ``weak_views`` is refused before
the first step; bad settings fail in ``__init__`` with the value named."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data import SimCLRViews
from ssl_lightning.methods import ReSSL
from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule

HEADS = dict(projection_hidden_dim=16, projection_dim=8, queue_size=16, head_batch_norm=False)


def _views() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]


def test_ressl_teacher_sees_the_second_view_without_gradient() -> None:
    model = ReSSL(SmallConvNet((4, 8), norm="group"), **HEADS)
    views = _views()
    outputs = model.forward_views(views)
    with torch.no_grad():
        key = model.teacher_projector(model.teacher_backbone(views[1]))
    torch.testing.assert_close(outputs["teacher"], torch.nn.functional.normalize(key, dim=1))
    assert not outputs["teacher"].requires_grad and outputs["student"].requires_grad
    before = model.queue.queue.clone()
    model.loss_from_outputs(outputs).backward()
    assert not torch.equal(model.queue.queue[:4], before[:4]) and int(model.queue.queue_ptr) == 4
    assert all(p.grad is None for p in model.teacher_backbone.parameters())


class _WithTransform(TensorDataModule):
    def __init__(self, transform: Any) -> None:
        super().__init__(PrecomputedViews(8), 4)
        self.train_transform = transform


@pytest.mark.parametrize("expected, transform", [(1, SimCLRViews()),
                                                 (0, SimCLRViews(num_views=1, weak_views=1))])
def test_ressl_refuses_other_weak_views_before_training(expected: int, transform: Any) -> None:
    model = ReSSL(SmallConvNet((4, 8), norm="group"), weak_views=expected, **HEADS)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=f"expects weak_views={expected}"):
        trainer.fit(model, datamodule=_WithTransform(transform))
    assert trainer.global_step == 0


@pytest.mark.parametrize("make, message", [
    (lambda b: ReSSL(b, weak_views=2), "weak_views"),
    (lambda b: ReSSL(b, queue_size=0), "queue_size"),
    (lambda b: ReSSL(b, teacher_temperature=0.0), "teacher_temperature"),
])
def test_bad_settings_fail_in_init(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make(SmallConvNet((4, 8), norm="group"))
