"""MAE and I-JEPA as methods: what the encoders see, the loss composition against
slow references, the target encoder (no gradient, one EMA update per optimiser step), exact
resume, LinearEval on their checkpoints, and the errors for bad input."""

from __future__ import annotations

import pytest
import torch
from evaluation_helpers import tiny_trainer
from mim_utils import GRID, PATCH, SIZE, tiny_ijepa, tiny_mae, tiny_vit
from momentum_utils import fit_and_resume, views_loader
from torch.utils.data import DataLoader, TensorDataset

import ssl_lightning.callbacks.ema as ema_module
from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.evaluation import LinearEval
from ssl_lightning.methods import IJEPA, MAE


def _count_tokens(module: torch.nn.Module) -> list[int]:
    """Token counts entering ``module`` (one entry per call)."""
    counts: list[int] = []
    module.register_forward_pre_hook(lambda m, args: counts.append(args[0].shape[1]))
    return counts


def test_mae_encoder_sees_only_the_visible_patches_and_loss_is_the_masked_patch_mse() -> None:
    torch.manual_seed(0)
    model = tiny_mae()
    x = torch.randn(4, 3, SIZE, SIZE)
    seen = _count_tokens(model.backbone.blocks[0])
    torch.manual_seed(5)
    out = model.forward_views([x])
    loss = model.loss_from_outputs(out)
    # 1 [CLS] + 25 % of 64 patches, then the unmasked forward for the kNN/probe features.
    assert seen == [1 + GRID * GRID // 4, 1 + GRID * GRID]
    torch.testing.assert_close(out["features"], model.backbone(x), atol=1e-6, rtol=0)
    torch.manual_seed(5)
    keep, masked = model.draw_masks(4)  # the RNG replay gives the masks the step used
    assert keep.shape == (4, 16) and masked.shape == (4, 48)
    pred = out["predictions"].detach().double()
    total, count = 0.0, 0
    for b in range(4):
        for i, j in enumerate(masked[b].tolist()):
            r, c = divmod(j, GRID)
            target = x[b, :, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
            target = target.permute(1, 2, 0).flatten().double()  # (row, col, channel)
            target = (target - target.mean()) / (target.var() + 1e-6).sqrt()
            total += float(((pred[b, i] - target) ** 2).sum())
            count += target.numel()
    assert abs(loss.item() - total / count) < 1e-5


def test_ijepa_predicts_each_target_block_from_its_own_context_and_target_gets_no_grad() -> None:
    torch.manual_seed(0)
    model = tiny_ijepa()
    with torch.no_grad():  # a target encoder that differs from the context encoder
        for p in model.teacher_backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(3, 3, SIZE, SIZE)
    context_seen = _count_tokens(model.backbone.blocks[0])
    target_seen = _count_tokens(model.teacher_backbone.blocks[0])
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


@pytest.mark.parametrize("factory", [tiny_mae, tiny_ijepa], ids=["mae", "ijepa"])
def test_resume_is_exact(tmp_path, factory) -> None:  # type: ignore[no-untyped-def]
    """Fit 2 epochs == fit 1, resume from its checkpoint (fresh process RNG), fit 1 more: the
    masks of epoch 2 come back with the checkpointed RNG state."""
    full, resumed = fit_and_resume(factory, lambda: views_loader(16, 4, num_views=1, size=SIZE),
                                   str(tmp_path), epochs=2)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


@pytest.mark.parametrize("name", ["mae", "ijepa"])
def test_linear_eval_reads_their_checkpoints(tmp_path, name: str) -> None:
    torch.manual_seed(0)
    model = tiny_mae() if name == "mae" else tiny_ijepa()
    trainer = tiny_trainer(max_steps=2)
    trainer.fit(model, views_loader(8, 4, num_views=1, size=SIZE))
    path = str(tmp_path / "pretrain.ckpt")
    trainer.save_checkpoint(path)
    prefix = "backbone." if name == "mae" else "teacher_backbone."
    linear = LinearEval(tiny_vit(pool="cls" if name == "mae" else "mean"), num_classes=4,
                        checkpoint=path, checkpoint_prefix=prefix, lr=0.1, lr_scaling="none")
    x = torch.randn(8, 3, SIZE, SIZE)
    model.eval()
    torch.testing.assert_close(linear.backbone(x), model.validation_step((x, x), 0)["features"])
    data = TensorDataset(torch.randn(16, 3, SIZE, SIZE), torch.arange(16) % 4)
    fit = tiny_trainer(max_epochs=1)
    fit.fit(linear, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    assert 0.0 <= float(fit.callback_metrics["val/top1"]) <= 100.0


def test_bad_input_is_refused_before_training() -> None:
    for method in (MAE, IJEPA):
        with pytest.raises(ValueError, match="needs a ViT backbone .* got SmallConvNet"):
            method(SmallConvNet((8, 16)), image_size=SIZE)
        with pytest.raises(ValueError, match="image_size 32 must be the backbone's image size 16"):
            method(tiny_vit(), image_size=32)
    with pytest.raises(ValueError, match=r"image_size \(30\) must be a multiple of patch_size"):
        ViT(image_size=30, patch_size=4)
    for ratio in (0.0, 1.0, 1.2):
        with pytest.raises(ValueError, match="mask_ratio"):
            tiny_mae(mask_ratio=ratio)
    with pytest.raises(ValueError, match="do not fit the 8x8 patch grid"):
        tiny_ijepa(target_scale=(0.9, 1.0))
    with pytest.raises(ValueError, match="expects views of 16x16 px"):
        tiny_mae().forward_views([torch.randn(2, 3, 32, 32)])


def test_vit_pool_mean_averages_the_patch_tokens_and_cls_stays_the_default() -> None:
    torch.manual_seed(0)
    vit = tiny_vit(num_registers=2)
    x = torch.randn(2, 3, SIZE, SIZE)
    tokens = vit.forward_tokens(x)
    torch.testing.assert_close(vit(x), tokens[:, 0])
    vit.pool = "mean"
    torch.testing.assert_close(vit(x), tokens[:, 3:].mean(dim=1))  # registers excluded
    with pytest.raises(ValueError, match="pool"):
        tiny_vit(pool="max")
