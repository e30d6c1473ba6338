"""EMA teacher update, momentum schedule and the callback."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from momentum_utils import cpu_trainer, fit_and_resume, views_loader
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from ssl_lightning.callbacks import EMACallback
from ssl_lightning.callbacks import ema as ema_module
from ssl_lightning.methods import SSLMethod
from ssl_lightning.optim import cosine_ramp
from ssl_lightning.training.ema import ema_update_, momentum_teacher


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


class TinyTeacherMethod(SSLMethod):
    """Student backbone (with BatchNorm) regressing a momentum teacher's normalised output."""

    def __init__(self) -> None:
        super().__init__(_net(), optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0,
                         weight_decay=0.0, image_size=16)
        self.teacher = momentum_teacher(self.backbone)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher)]

    def training_loss(self, views):  # type: ignore[no-untyped-def]
        features = self.backbone(views[0])
        with torch.no_grad():
            target = self.teacher(views[1])
        loss = (F.normalize(features, dim=1) - F.normalize(target, dim=1)).pow(2).sum(1).mean()
        return loss, features


def _student_teacher() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    student, teacher = _net(), _net()
    student(torch.randn(8, 3, 16, 16))  # give the student non-default BN statistics
    return student, teacher


def test_momentum_teacher_is_frozen_independent_copy() -> None:
    student = _net()
    teacher = momentum_teacher(student)
    assert all(not p.requires_grad for p in teacher.parameters())
    assert all(p.requires_grad for p in student.parameters())
    for s, t in zip(student.parameters(), teacher.parameters(), strict=True):
        assert torch.equal(s, t) and s.data_ptr() != t.data_ptr()


def test_tau_zero_copies_student_and_tau_one_keeps_teacher() -> None:
    student, teacher = _student_teacher()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    ema_update_([(student, teacher)], tau=1.0, buffer_policy="none")
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, before[k]), k
    ema_update_([(student, teacher)], tau=0.0, buffer_policy="copy")
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, student.state_dict()[k]), k


@pytest.mark.parametrize("policy", ["copy", "ema", "none"])
def test_update_matches_formula_and_buffer_policy(policy: str) -> None:
    student, teacher = _student_teacher()
    s_state = {k: v.clone() for k, v in student.state_dict().items()}
    t_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    tau = 0.9
    ema_update_([(student, teacher)], tau=tau, buffer_policy=policy)
    params = dict(student.named_parameters())
    for k, v in teacher.state_dict().items():
        if k in params:  # parameter: the EMA rule, element by element
            expected = tau * t_state[k] + (1 - tau) * s_state[k]
        elif policy == "none":
            expected = t_state[k]
        elif policy == "ema" and v.is_floating_point():
            expected = tau * t_state[k] + (1 - tau) * s_state[k]
        else:  # "copy", and integer counters under "ema"
            expected = s_state[k]
        torch.testing.assert_close(v, expected, rtol=0, atol=1e-7, msg=f"{policy} {k}")
    assert teacher[1].num_batches_tracked.item() == (0 if policy == "none" else 1)


def test_cosine_schedule_values() -> None:
    total, base = 1000, 0.99
    assert cosine_ramp(0, total, base) == pytest.approx(base)
    assert cosine_ramp(total // 2, total, base) == pytest.approx((1 + base) / 2)
    assert cosine_ramp(total, total, base) == pytest.approx(1.0)
    k = 137
    assert cosine_ramp(k, total, base) == pytest.approx(
        1 - (1 - base) * (math.cos(math.pi * k / total) + 1) / 2)
    assert cosine_ramp(2 * total, total, base) == pytest.approx(1.0)
    cb = EMACallback(momentum_base=0.996, momentum_end=0.999)
    assert cb.momentum(total, total) == pytest.approx(0.999)
    constant = EMACallback(momentum_base=0.99, schedule="constant")
    assert constant.momentum(0, total) == constant.momentum(total, total) == 0.99


@pytest.mark.parametrize("kwargs", [{"momentum_base": 1.5}, {"momentum_end": -0.1},
                                    {"schedule": "linear"}, {"buffer_policy": "mean"}])
def test_invalid_arguments_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=str(next(iter(kwargs.values())))):
        EMACallback(**kwargs)


def test_callback_rejects_missing_pairs_and_trainable_teacher() -> None:
    trainer = SimpleNamespace(global_step=0, estimated_stepping_batches=10)
    with pytest.raises(ValueError, match="ema_pairs"):
        EMACallback().on_train_start(trainer, SSLMethod(_net(), image_size=16))
    method = TinyTeacherMethod()
    method.teacher.requires_grad_(True)
    with pytest.raises(ValueError, match="requires_grad"):
        EMACallback().on_train_start(trainer, method)
    method.teacher.requires_grad_(False)
    endless = SimpleNamespace(global_step=0, estimated_stepping_batches=float("inf"))
    with pytest.raises(ValueError, match="infinite"):
        EMACallback().on_train_start(endless, method)
    EMACallback(schedule="constant").on_train_start(endless, method)  # needs no total


@pytest.fixture
def recorded_taus(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the tau of every ``ema_update_`` the callback makes."""
    taus: list[float] = []
    real = ema_module.ema_update_

    def record(pairs, tau, buffer_policy="copy"):  # type: ignore[no-untyped-def]
        taus.append(tau)
        real(pairs, tau, buffer_policy)

    monkeypatch.setattr(ema_module, "ema_update_", record)
    return taus


@pytest.mark.parametrize("accumulate", [1, 3])
def test_one_update_per_optimizer_step(tmp_path, recorded_taus: list[float], accumulate: int
                                       ) -> None:
    # 16 samples / batch 4 = 4 micro-batches per epoch; with accumulate=3 Lightning steps after
    # micro-batches 3 and 4 (end of epoch), so 2 optimiser steps per epoch.
    model = TinyTeacherMethod()
    trainer = cpu_trainer(str(tmp_path), 2, accumulate_grad_batches=accumulate,
                          callbacks=[EMACallback(momentum_base=0.9)], enable_checkpointing=False)
    trainer.fit(model, views_loader(16, 4))
    steps = trainer.global_step
    assert steps == (8 if accumulate == 1 else 4)
    assert trainer.estimated_stepping_batches == steps
    assert recorded_taus == [pytest.approx(cosine_ramp(k, steps, 0.9)) for k in range(steps)]
    assert float(trainer.callback_metrics["ema/tau"]) == pytest.approx(recorded_taus[-1])


def test_resume_continues_schedule_and_teacher_exactly(tmp_path, recorded_taus: list[float]
                                                       ) -> None:
    full, resumed = fit_and_resume(
        TinyTeacherMethod, lambda: views_loader(16, 4), str(tmp_path), epochs=2,
        make_callbacks=lambda: [EMACallback(momentum_base=0.9)],
    )
    assert len(recorded_taus) == 8 + 4  # uninterrupted run, then the resumed second epoch
    assert recorded_taus[8:] == recorded_taus[4:8]
    assert any(k.startswith("teacher.") for k in full)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_resume_with_fewer_steps_per_epoch_converts_the_momentum_position(
        tmp_path, recorded_taus: list[float]) -> None:
    """Epoch 0 at batch 4 (4 steps), epoch 1 resumed at batch 8 (2 steps): like the lr, the
    momentum schedule continues at "1 of 2 epochs done" = step 2 of the new 4-step schedule,
    not at step 4 (which would be its end, tau = 1: a frozen teacher for the whole epoch)."""
    model = TinyTeacherMethod()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=1,
                           filename="{epoch}")
    cpu_trainer(str(tmp_path), 1, callbacks=[ckpt, EMACallback(momentum_base=0.9)]).fit(
        model, views_loader(16, 4))
    assert recorded_taus == [pytest.approx(cosine_ramp(k, 4, 0.9)) for k in range(4)]
    recorded_taus.clear()
    with pytest.warns(UserWarning, match="steps per epoch 4 -> 2"):
        cpu_trainer(str(tmp_path), 2, callbacks=[EMACallback(momentum_base=0.9)],
                    enable_checkpointing=False).fit(TinyTeacherMethod(), views_loader(16, 8),
                                                    ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert recorded_taus == [pytest.approx(cosine_ramp(k, 4, 0.9)) for k in (2, 3)]
    assert max(recorded_taus) < 1
