"""LARS (hand-computed updates, norms/biases excluded from decay and adaptation), parameter
groups, warm-up + cosine values, the LR scaling rules, and their wiring in SSLMethod."""

from __future__ import annotations

import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import SimCLR
from ssl_lightning.optim import (
    LARS,
    WarmupCosine,
    WarmupCosineLR,
    build_optimizer,
    scale_lr,
    split_decay_groups,
)
from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_split_decay_groups_puts_biases_and_norms_in_the_no_decay_group() -> None:
    net = _net()
    net[2].bias.requires_grad_(False)  # frozen parameters are skipped
    decay, no_decay = split_decay_groups([net, net[0]], weight_decay=0.5)  # net[0] seen twice
    assert [id(p) for p in decay["params"]] == [id(net[0].weight), id(net[2].weight)]
    assert [id(p) for p in no_decay["params"]] == [
        id(net[0].bias), id(net[1].weight), id(net[1].bias)]
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert no_decay["exclude_from_lars"] is True


def test_lars_two_steps_match_hand_computed_update() -> None:
    net = _net()
    lr, momentum, wd, eta = 0.5, 0.9, 0.01, 0.001
    optimizer = LARS(split_decay_groups([net], wd), lr=lr, momentum=momentum,
                     trust_coefficient=eta)
    initial = {n: p.detach().numpy().astype(np.float64).copy() for n, p in net.named_parameters()}
    params, buffers, grads_seen = dict(initial), {}, []
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optimizer.zero_grad()
        net(x).pow(2).sum().backward()
        grads = {n: p.grad.numpy().astype(np.float64) for n, p in net.named_parameters()}
        grads_seen.append(grads)
        optimizer.step()
        for name, g in grads.items():
            w = params[name]
            if w.ndim > 1:  # weights: decay added to the gradient, then the trust ratio
                g = g + wd * w
                g = g * (eta * np.linalg.norm(w) / (np.linalg.norm(g) + 1e-8))
            # biases and BatchNorm parameters: plain SGD with momentum, no decay
            buffers[name] = g if name not in buffers else momentum * buffers[name] + g
            params[name] = w - lr * buffers[name]
    for name, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), params[name], rtol=1e-5, atol=1e-7)
    # The exclusion matters: the BN weight moved by a full SGD step, far more than the trust
    # ratio (eta = 1e-3) would allow.
    assert np.abs(params["1.weight"] - initial["1.weight"]).max() > 10 * eta * lr


def test_warmup_cosine_values() -> None:
    schedule = WarmupCosine(warmup_steps=10, total_steps=110, final_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)  # first step: 1 / warmup of the peak
    assert schedule(4) == pytest.approx(0.5)
    assert schedule(9) == pytest.approx(1.0)  # end of warm-up: the peak
    assert schedule(10) == pytest.approx(1.0)  # start of the cosine
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way down the cosine
    assert schedule(85) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)))
    assert schedule(110) == pytest.approx(0.1)  # end
    assert schedule(500) == pytest.approx(0.1)  # stays at the floor
    assert WarmupCosine(0, 5)(0) == pytest.approx(1.0)  # no warm-up
    with pytest.raises(ValueError, match="warmup_steps \\(7\\) <= total_steps \\(5\\)"):
        WarmupCosine(7, 5)


def test_lr_scaling_rules() -> None:
    assert scale_lr(0.3, 512, "linear") == pytest.approx(0.6)  # base × B / 256
    assert scale_lr(0.075, 4096, "sqrt") == pytest.approx(4.8)  # base × sqrt(B), SimCLR B.1
    assert scale_lr(0.3, 512, "none") == 0.3
    with pytest.raises(ValueError, match="'cubic'"):
        scale_lr(0.3, 512, "cubic")  # type: ignore[arg-type]


def test_build_optimizer_keeps_group_decay_and_rejects_unknown_names() -> None:
    groups = split_decay_groups([_net()], weight_decay=0.05)
    for name, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW), ("lars", LARS)):
        optimizer = build_optimizer(name, groups, lr=0.1)
        assert isinstance(optimizer, cls)
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    with pytest.raises(ValueError, match="'adam'"):
        build_optimizer("adam", groups, lr=0.1)  # type: ignore[arg-type]


class _RecordLR(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_ssl_method_schedule_is_per_step_with_scaled_peak() -> None:
    torch.manual_seed(0)
    model = SimCLR(SmallConvNet(widths=(4,)), projection_hidden_dim=8, projection_dim=4,
                   optimizer="sgd", lr=0.4, lr_scaling="linear", warmup_epochs=1,
                   final_lr_ratio=0.0)
    record = _RecordLR()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, callbacks=[record],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=TensorDataModule(PrecomputedViews(16), batch_size=4))
    peak = 0.4 * 4 / 256  # linear rule with a global batch of 4
    schedule = WarmupCosine(4, 8)  # 1 warm-up epoch of 4 steps, 8 steps in all
    np.testing.assert_allclose(record.lrs, [peak * schedule(s) for s in range(8)], rtol=1e-12)


def test_ssl_method_passes_the_lars_trust_coefficient_and_validates_it() -> None:
    model = SimCLR(SmallConvNet(widths=(4,)), projection_hidden_dim=8, projection_dim=4,
                   optimizer="lars", lars_trust_coefficient=0.02, warmup_epochs=0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=TensorDataModule(PrecomputedViews(8), batch_size=4))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, LARS)
    assert {g["trust_coefficient"] for g in optimizer.param_groups} == {0.02}
    with pytest.raises(ValueError, match="lars_trust_coefficient must be > 0, got 0.0"):
        SimCLR(SmallConvNet(widths=(4,)), lars_trust_coefficient=0.0)


def _resumed(old: torch.optim.lr_scheduler.LRScheduler, steps: int, **new_kwargs):
    """Step ``old`` ``steps`` times, then resume a fresh WarmupCosineLR from its state in
    Lightning's order: build optimiser and scheduler, load the optimiser, load the scheduler."""
    for _ in range(steps):
        old.optimizer.step()
        old.step()
    net = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(split_decay_groups([net], 0.1), lr=new_kwargs.pop("lr", 0.4))
    new = WarmupCosineLR(optimizer, **new_kwargs)
    optimizer.load_state_dict(old.optimizer.state_dict())
    new.load_state_dict(old.state_dict())
    return new


def _scheduler(lr: float = 0.4, **kwargs) -> WarmupCosineLR:
    net = nn.Linear(2, 2)
    return WarmupCosineLR(torch.optim.SGD(split_decay_groups([net], 0.1), lr=lr), **kwargs)


def test_warmup_cosine_lr_resumes_the_position_with_the_new_schedule() -> None:
    same = dict(warmup_steps=2, total_steps=8, steps_per_epoch=4, fixed_groups=[False, True])
    old = _scheduler(**same)
    new = _resumed(old, 5, **same)  # unchanged: the identical state and lrs
    assert new.state_dict() == old.state_dict()
    assert [g["lr"] for g in new.optimizer.param_groups] == [0.4 * WarmupCosine(2, 8)(5), 0.4]
    # max_epochs 2 -> 4: the 16-step cosine at step 5, peak 0.4 -> 0.2 (new lr), warned
    with pytest.warns(UserWarning, match="total steps 8 -> 16; peak lr 0.4 -> 0.2"):
        new = _resumed(_scheduler(**same), 5, lr=0.2, warmup_steps=2, total_steps=16,
                       steps_per_epoch=4)
    assert new.optimizer.param_groups[0]["lr"] == 0.2 * WarmupCosine(2, 16)(5)
    # steps per epoch 4 -> 2 (double batch), max_epochs-bounded: 6 steps = 1.5 epochs = step 3
    with pytest.warns(UserWarning, match="steps per epoch 4 -> 2"):
        new = _resumed(_scheduler(**same), 6, warmup_steps=1, total_steps=4, steps_per_epoch=2)
    assert new.step_shift == -3 and new.get_last_lr()[0] == 0.4 * WarmupCosine(1, 4)(3)
    with pytest.warns(UserWarning):  # max_steps-bounded: the position stays the global step
        new = _resumed(_scheduler(**same), 6, warmup_steps=1, total_steps=10, steps_per_epoch=2,
                       epoch_based=False)
    assert new.step_shift == 0 and new.get_last_lr()[0] == 0.4 * WarmupCosine(1, 10)(6)


def test_warmup_cosine_lr_reads_a_lambda_lr_state_and_refuses_another_optimizer() -> None:
    net = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(split_decay_groups([net], 0.1), lr=0.4)
    legacy = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(0, 4))
    with pytest.warns(UserWarning, match="total steps 4 -> 8"):
        new = _resumed(legacy, 4, warmup_steps=0, total_steps=8)
    assert new.get_last_lr()[0] == pytest.approx(0.2)  # half-way down the 8-step cosine
    old = _scheduler(warmup_steps=0, total_steps=4)
    old.optimizer_class = "LARS"
    with pytest.raises(ValueError, match="optimiser state is of LARS, this run uses SGD"):
        _resumed(old, 1, warmup_steps=0, total_steps=4)
