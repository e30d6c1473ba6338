"""I-JEPA (Assran et al., CVPR 2023) as a method: each target block predicted from its own
context against a slow reference, the target encoder (no gradient, one EMA update per optimiser
step), exact resume, LinearEval on its checkpoints and the errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from evaluation_helpers import tiny_trainer
from mim_utils import (
    GRID,
    SIZE,
    assert_linear_eval_reads_the_checkpoint,
    count_tokens,
    tiny_ijepa,
    tiny_vit,
)
from momentum_utils import views_loader

import ssl_lightning.callbacks.ema as ema_module
from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import IJEPA


def test_ijepa_predicts_each_target_block_from_its_own_context_and_target_gets_no_grad() -> None:
    torch.manual_seed(0)
    model = tiny_ijepa()
    with torch.no_grad():  # a target encoder that differs from the context encoder
        for p in model.teacher_backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(3, 3, SIZE, SIZE)
    context_seen = count_tokens(model.backbone.blocks[0])
    target_seen = count_tokens(model.teacher_backbone.blocks[0])
    torch.manual_seed(5)
    out = model.forward_views([x])
    torch.manual_seed(5)
    context, targets = model.draw_masks(3)
    assert context_seen == [1 + context.shape[1]] and target_seen == [1 + GRID * GRID]
    with torch.no_grad():
        for b in range(3):
            ctx = model.backbone.forward_tokens(x[b:b + 1], keep=context[b:b + 1])[:, 1:]
            full = model.teacher_backbone.forward_tokens(x[b:b + 1])[0, 1:]
            for m in range(targets.shape[1]):
                pred = model.predictor(ctx, context[b:b + 1], targets[b:b + 1, m])[0]
                torch.testing.assert_close(out["predictions"][b, m], pred, atol=1e-5, rtol=0)
                torch.testing.assert_close(out["targets"][b, m], full[targets[b, m]])
        torch.testing.assert_close(out["features"], model.teacher_backbone(x))
    model.loss_from_outputs(out).backward()
    assert all(p.grad is None and not p.requires_grad for p in model.teacher_backbone.parameters())
    assert all(p.grad is not None for p in model.predictor.parameters())
    assert model.backbone.patch_embed.weight.grad is not None


def test_ijepa_updates_the_target_once_per_optimizer_step(monkeypatch) -> None:
    """accumulate_grad_batches=2 over 4 batches: 2 optimiser steps, 2 EMA updates, each
    ``target = tau·target + (1 − tau)·student`` with the student after the step."""
    calls: list[float] = []
    original = ema_module.ema_update_

    def checked(pairs, tau, buffer_policy="copy"):  # type: ignore[no-untyped-def]
        (student, teacher), = pairs
        before = [t.clone() for t in teacher.parameters()]
        original(pairs, tau, buffer_policy)
        for s, t, t0 in zip(student.parameters(), teacher.parameters(), before, strict=True):
            torch.testing.assert_close(t, tau * t0 + (1 - tau) * s.detach(), atol=1e-6, rtol=0)
        calls.append(tau)

    monkeypatch.setattr(ema_module, "ema_update_", checked)
    torch.manual_seed(0)
    model = tiny_ijepa()
    trainer = tiny_trainer(max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(model, views_loader(16, 4, num_views=1, size=SIZE))
    assert trainer.global_step == 2
    callback = model.ema_callback
    assert calls == [callback.momentum(0, 2), callback.momentum(1, 2)] and calls[0] == 0.9
    optimised = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not optimised & {id(p) for p in model.teacher_backbone.parameters()}


def test_linear_eval_reads_its_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(0)
    assert_linear_eval_reads_the_checkpoint(tiny_ijepa(), "teacher_backbone.", "mean", tmp_path)


def test_bad_input_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match="needs a ViT backbone .* got SmallConvNet"):
        IJEPA(SmallConvNet((8, 16)), image_size=SIZE)
    with pytest.raises(ValueError, match="image_size 32 must be the backbone's image size 16"):
        IJEPA(tiny_vit(), image_size=32)
    with pytest.raises(ValueError, match="do not fit the 8x8 patch grid"):
        tiny_ijepa(target_scale=(0.9, 1.0))
