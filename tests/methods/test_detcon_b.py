"""DetCon-B: online predictions against the momentum teacher's projections of the same segments,
the teacher gets no gradient, micro-batches with boxes. The masks and their errors are shared
with DetCon-S (tests/methods/test_detcon_s.py); the loss: tests/losses/test_detcon_loss.py."""

from __future__ import annotations

import pytest
import torch
from micro_batch_utils import whole_and_micro_batch_gradients
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import DetConLoss
from ssl_lightning.methods import DetConB

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(projection_hidden_dim=16, projection_dim=8, head_batch_norm=False, grid=2,
             image_size=8, segment_image_size=32)


def _model(**kwargs: object) -> DetConB:
    torch.manual_seed(0)
    return DetConB(SmallConvNet((8, 16), norm="group"), **{**SMALL, **kwargs}).double()


def _batch(seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    views = [torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    boxes = [torch.tensor([[top, left, 20.0, 20.0, f] for top, left, f in
                           ((0, 0, 0), (4, 2, 1), (8, 8, 0), (12, 6, 1))], dtype=torch.float64)
             + 4 * k for k in range(2)]
    return views + boxes


def test_detcon_b_predicts_the_teachers_segments() -> None:
    model = _model()
    with torch.no_grad():  # a teacher that differs from the student
        for p in model.teacher_backbone.parameters():
            p.add_(0.1)
    batch = _batch()
    outputs = model.forward_views(batch)
    teacher, ids, _ = model.segments(model.teacher_backbone, batch, 1)
    assert torch.equal(ids, outputs["ids2"])
    torch.testing.assert_close(outputs["z2"], model.teacher_projector(teacher), rtol=1e-12,
                               atol=1e-12)
    student, _, _ = model.segments(model.backbone, batch, 1)
    torch.testing.assert_close(outputs["p2"], model.predictor(model.projector(student)),
                               rtol=1e-12, atol=1e-12)
    assert not outputs["z2"].requires_grad
    expected = DetConLoss(0.1)(outputs["p1"], outputs["p2"], outputs["z1"], outputs["z2"],
                               outputs["ids1"], outputs["ids2"], outputs["ids1"], outputs["ids2"])
    assert float(model.loss_from_outputs(outputs)) == pytest.approx(float(expected), rel=1e-12)
    loss = model.training_loss(batch)[0]
    loss.backward()
    assert all(p.grad is None for p in model.teacher_backbone.parameters())
    assert all(p.grad is not None for p in model.predictor.parameters())


def test_detcon_b_micro_batches_with_boxes_give_the_whole_batch_gradient() -> None:
    batch = _batch(1)
    whole, micro = whole_and_micro_batch_gradients(
        lambda micro: _model(micro_batch_size=micro), batch)
    torch.testing.assert_close(whole, micro, rtol=0, atol=1e-12)


def test_detcon_b_bad_input() -> None:
    with pytest.raises(ValueError, match="grid, segment_image_size and num_segments"):
        _model(num_segments=0)
    with pytest.raises(ValueError, match="DetConB needs 2 views per sample, got 1"):
        _model().training_loss(_batch()[:1])
