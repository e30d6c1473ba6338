"""MoCo v2, MoCo v3 and BYOL as Lightning modules: their own EMA callback, exact resume
and the method-level errors and options."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from momentum_utils import fit_and_resume, views_loader

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.callbacks import EMACallback
from ssl_lightning.methods import BYOL, MoCoV2, MoCoV3, MomentumMethod

COMMON = dict(projection_hidden_dim=16, projection_dim=8, optimizer="sgd", lr=0.5,
              lr_scaling="none", warmup_epochs=0, image_size=8)


def _moco_v2(**kwargs) -> MoCoV2:  # type: ignore[no-untyped-def]
    return MoCoV2(SmallConvNet((8, 16)), queue_size=8, momentum_base=0.9, **COMMON, **kwargs)


def _moco_v3() -> MoCoV3:
    return MoCoV3(SmallConvNet((8, 16)), projection_layers=2, momentum_base=0.9, **COMMON)


def _byol() -> BYOL:
    return BYOL(SmallConvNet((8, 16)), momentum_base=0.9, **COMMON)


FACTORIES: dict[str, Callable[[], MomentumMethod]] = {
    "moco_v2": _moco_v2, "moco_v3": _moco_v3, "byol": _byol}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_method_supplies_its_ema_callback_and_frozen_teacher(name: str) -> None:
    model = FACTORIES[name]()
    (callback,) = model.configure_callbacks()
    assert isinstance(callback, EMACallback)
    assert callback.momentum_base == 0.9
    assert callback.schedule == ("constant" if name == "moco_v2" else "cosine")
    teachers = {id(t) for _, t in model.ema_pairs()}
    assert len(teachers) == 2
    for _, teacher in model.ema_pairs():
        assert all(not p.requires_grad for p in teacher.parameters())
    trainable = {id(p) for m in model.trainable_modules() for p in m.parameters()}
    assert not any(id(p) in trainable for _, t in model.ema_pairs() for p in t.parameters())


def test_invalid_momentum_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="1.5"):
        BYOL(SmallConvNet((8, 16)), momentum_base=1.5, image_size=8)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_resume_is_exact(tmp_path, name: str) -> None:
    """Teacher, queue, pointer and the tau position after fit 2 epochs == fit 1 + resume."""
    full, resumed = fit_and_resume(FACTORIES[name], lambda: views_loader(16, 4, size=8),
                                   str(tmp_path), epochs=2)
    teacher_keys = [k for k in full if k.startswith("teacher_")]
    assert teacher_keys
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    # The EMA ran (the teacher left its initial value) with tau < 1 (it is not the student),
    # so equality above pins the tau sequence of the resumed run.
    torch.manual_seed(0)
    initial = FACTORIES[name]().state_dict()
    assert any(not torch.equal(full[k], initial[k]) for k in teacher_keys)
    teacher_of = {k.split("_", 1)[1]: k for k in teacher_keys}  # student name -> teacher name
    assert any(not torch.equal(full[s], full[t]) for s, t in teacher_of.items()
               if full[s].is_floating_point())
    if name == "moco_v2":
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


def test_moco_v3_and_byol_pair_each_query_with_the_other_views_key() -> None:
    """The method losses are the papers' compositions: ctr(q1, k2) + ctr(q2, k1) for MoCo v3 and
    L(p1, z2') + L(p2, z1') for BYOL (a swap of the views would still give a valid-looking loss)."""
    views = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    for model in (_moco_v3(), _byol()):
        model.train()
        teacher_bb, teacher_proj = (t for _, t in model.ema_pairs())
        for _, t in model.ema_pairs():  # make the teacher differ from the student
            for p in t.parameters():
                p.data.add_(0.1 * torch.randn_like(p))
        loss, _ = model.training_loss(views)
        with torch.no_grad():
            p1, p2 = (model.predictor(model.projector(model.backbone(v))) for v in views)
            z1, z2 = (teacher_proj(teacher_bb(v)) for v in views)
            if isinstance(model, MoCoV3):
                expected = model.criterion(p1, z2) + model.criterion(p2, z1)
                swapped = model.criterion(p1, z1) + model.criterion(p2, z2)
            else:
                expected = model.criterion(p1, p2, z1, z2)
                swapped = model.criterion(p1, p2, z2, z1)
        torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=0)
        assert not torch.allclose(swapped, expected, atol=1e-3)
