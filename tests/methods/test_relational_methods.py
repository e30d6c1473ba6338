"""ReSSL and All4One as modules: the teacher sees the second (weak) view and gets no gradient;
ReSSL refuses a data transform whose weak views differ from its ``weak_views`` before the first
step; All4One's transformer and shift predictor are trained; bad settings fail in ``__init__``
with the value named."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data import SimCLRViews
from ssl_lightning.methods import All4One, ReSSL
from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule

HEADS = dict(projection_hidden_dim=16, projection_dim=8, queue_size=16, head_batch_norm=False)
SMALL = dict(neighbours=3, transformer_layers=1, transformer_heads=2, predictor_hidden_dim=8)


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


def test_all4one_trains_its_transformer_and_shift_predictor() -> None:
    model = All4One(SmallConvNet((4, 8), norm="group"), **HEADS, **SMALL)
    loss, _ = model.training_loss(_views())
    loss.backward()
    for part in (model.transformer, model.shift_predictor, model.predictor, model.projector):
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in part.parameters())
    assert int(model.support_set.queue_ptr) == 4


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
    (lambda b: All4One(b, neighbours=1), "neighbours"),
    (lambda b: All4One(b, queue_size=4, neighbours=5), "neighbours"),
    (lambda b: All4One(b, projection_dim=12, transformer_heads=8), "transformer_heads"),
    (lambda b: All4One(b, transformer_dropout=1.0), "dropout"),
    (lambda b: All4One(b, feature_weight=-1.0), "feature_weight"),
])
def test_bad_settings_fail_in_init(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(SmallConvNet((4, 8), norm="group"))


def test_support_set_top_k_is_ordered_and_checked() -> None:
    from ssl_lightning.queues import NearestNeighbourSupport

    support = NearestNeighbourSupport(6, 3)
    support.add(torch.eye(3).repeat(2, 1) * torch.tensor([[1.0], [1.0], [1.0], [2.0], [3.0],
                                                          [4.0]]))
    query = torch.tensor([[1.0, 0.2, 0.1]])
    top = support.top_k(query, 3)
    scores = torch.nn.functional.normalize(top[0], dim=1) @ torch.nn.functional.normalize(
        query[0], dim=0)
    assert torch.all(scores[:-1] >= scores[1:]) and torch.equal(top[:, 0],
                                                                 support.nearest(query))
    with pytest.raises(ValueError, match="k must be in"):
        support.top_k(query, 7)
    with pytest.raises(ValueError, match="queue_size"):
        NearestNeighbourSupport(0, 3)
