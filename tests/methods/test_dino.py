"""DINO: head, crops seen by student/teacher, schedules, gradient adjustments, freeze period,
weight-decay schedule and exact resume (centre, teacher, schedules)."""

from __future__ import annotations

import inspect
import math

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from momentum_utils import cpu_trainer, fit_and_resume, state_of
from multicrop_utils import (
    DINO_SMALL,
    CountingModule,
    masked_vit,
    multicrop_loader,
    multicrop_views,
)

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.heads import DINOHead
from ssl_lightning.methods import DINO, IBOT, DINOv2, DINOv3


def make_dino(**kwargs) -> DINO:
    args = dict(head_out_dim=32, head_hidden_dim=16, head_bottleneck_dim=8, optimizer="adamw",
                lr=1e-3, lr_scaling="none", warmup_epochs=0, weight_decay=0.04,
                warmup_teacher_temperature_epochs=1, freeze_last_layer_epochs=1)
    args.update(kwargs)
    return DINO(SmallConvNet((8, 16), norm="group"), **args)


def test_head_matches_formula():
    torch.manual_seed(0)
    head = DINOHead(6, out_dim=5, hidden_dim=7, bottleneck_dim=4)
    x = torch.randn(3, 6)
    h = x
    for layer in head.mlp:
        h = layer(h)
    w = head.last_layer_v / head.last_layer_v.norm(dim=1, keepdim=True)
    torch.testing.assert_close(head(x), F.normalize(h, dim=1) @ w.T)
    assert head(x).abs().max() <= 1 + 1e-6  # unit vectors against unit rows
    assert not head.last_layer_g.requires_grad
    assert sum(isinstance(m, torch.nn.GELU) for m in head.mlp) == 2
    free = DINOHead(6, 5, 7, 4, norm_last_layer=False)
    assert free.last_layer_g.requires_grad
    with torch.no_grad():
        free.last_layer_g.fill_(2.0)
    assert free(x).abs().max() > 1


def test_student_sees_all_crops_teacher_only_globals_one_call_per_resolution():
    torch.manual_seed(0)
    model = DINO(CountingModule(SmallConvNet((8, 16))), head_out_dim=16, head_hidden_dim=8,
                 head_bottleneck_dim=4)
    views = [torch.randn(3, 3, s, s) for s in (16, 16, 8, 8, 8)]
    loss, features = model.training_loss(views)
    assert model.backbone.calls == [(6, 3, 16, 16), (9, 3, 8, 8)]
    assert model.teacher_backbone.calls == [(6, 3, 16, 16)]
    assert features.shape == (3, 16) and loss.ndim == 0
    loss.backward()
    assert all(p.grad is None for p in model.teacher_head.parameters())


def test_teacher_temperature_warmup():
    model = make_dino(warmup_teacher_temperature=0.04, teacher_temperature=0.07,
                      warmup_teacher_temperature_epochs=3)
    temps = [model.teacher_temperature(e) for e in range(5)]
    assert temps == pytest.approx([0.04, 0.055, 0.07, 0.07, 0.07])  # np.linspace(.04, .07, 3)
    assert make_dino(warmup_teacher_temperature_epochs=0).teacher_temperature(0) == 0.07


def test_teacher_has_no_stochastic_depth_and_no_grad():
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              drop_path_rate=0.2)
    model = DINO(vit, head_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4)
    rates = [m.drop_prob for m in model.backbone.modules() if isinstance(m, DropPath)]
    assert max(rates) == pytest.approx(0.2)
    assert all(m.drop_prob == 0 for m in model.teacher_backbone.modules()
               if isinstance(m, DropPath))
    assert not any(p.requires_grad for p in model.teacher_backbone.parameters())
    assert model.ema_pairs() == [(model.backbone, model.teacher_backbone),
                                 (model.head, model.teacher_head)]


def test_per_parameter_clipping_and_last_layer_freeze():
    model = make_dino(clip_grad=3.0, freeze_last_layer_epochs=2)
    params = model.trainable_parameters()
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 10.0 if i % 2 else 1e-3)
    small = {id(p): p.grad.clone() for i, p in enumerate(params) if i % 2 == 0}
    model.adjust_gradients_(epoch=1)
    for i, p in enumerate(params):
        if p.grad is None:
            assert any(p is q for q in model.head.last_layer_parameters())
        elif i % 2:
            assert torch.linalg.vector_norm(p.grad).item() == pytest.approx(3.0, rel=1e-5)
        else:
            assert torch.equal(p.grad, small[id(p)])
    assert model.head.last_layer_v.grad is None
    for p in params:
        p.grad = torch.ones_like(p)
    model.adjust_gradients_(epoch=2)
    assert model.head.last_layer_v.grad is not None


@pytest.mark.parametrize(
    "kwargs",
    [dict(teacher_temperature=0.0), dict(warmup_teacher_temperature=-1.0),
     dict(warmup_teacher_temperature_epochs=-1), dict(freeze_last_layer_epochs=-1),
     dict(clip_grad=0.0), dict(weight_decay_end=-0.1), dict(head_out_dim=0)],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        make_dino(**kwargs)


class RecordSteps(pl.Callback):
    """Last-layer weights and the decay group's weight decay after every optimiser step."""

    def __init__(self) -> None:
        self.last_layer: list[torch.Tensor] = []
        self.weight_decay: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last_layer.append(pl_module.head.last_layer_v.detach().clone())
        self.weight_decay.append(trainer.optimizers[0].param_groups[0]["weight_decay"])


def test_freeze_period_and_weight_decay_schedule(tmp_path):
    torch.manual_seed(0)
    model = make_dino(weight_decay_end=0.4)
    initial = state_of(model)
    recorder = RecordSteps()
    cpu_trainer(str(tmp_path), 2, callbacks=[recorder], enable_checkpointing=False).fit(
        model, multicrop_loader())
    # Epoch 0 (4 steps): the last layer is frozen; epoch 1 updates it.
    for weights in recorder.last_layer[:4]:
        assert torch.equal(weights, initial["head.last_layer_v"])
    assert not torch.equal(recorder.last_layer[4], initial["head.last_layer_v"])
    assert not torch.equal(model.head.mlp[0].weight, initial["head.mlp.0.weight"])
    assert not torch.equal(model.teacher_head.mlp[0].weight, initial["teacher_head.mlp.0.weight"])
    assert model.criterion.center.abs().sum() > 0
    # Cosine weight decay 0.04 -> 0.4 over the 8 optimiser steps (value used at step s), on the
    # decay group only.
    expected = [0.4 - 0.36 * (math.cos(math.pi * s / 8) + 1) / 2 for s in range(8)]
    assert recorder.weight_decay == pytest.approx(expected)
    groups = model.param_groups()
    assert groups[0].get("weight_decay_schedule") is True and groups[1]["weight_decay"] == 0.0


def test_exact_resume_centre_teacher_and_schedules(tmp_path):
    full, resumed = fit_and_resume(lambda: make_dino(weight_decay_end=0.4),
                                   multicrop_loader, str(tmp_path))
    assert full.keys() == resumed.keys()
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key
    assert full["criterion.center"].abs().sum() > 0


@pytest.mark.parametrize("preset", [IBOT, DINOv2, DINOv3])
def test_presets_are_dino_with_their_defaults(preset: type[DINO]) -> None:
    """A preset is DINO with its defaults passed explicitly: the same modules, weights, loss."""
    extra: dict = dict(num_local_crops=2)
    if preset is DINOv3:
        extra.update(patch_hidden_dim=12, patch_bottleneck_dim=6, patch_out_dim=24)
    torch.manual_seed(0)
    made = preset(masked_vit(), **DINO_SMALL, **extra)
    defaults = {name: parameter.default
                for name, parameter in inspect.signature(preset.__init__).parameters.items()
                if name not in ("self", "backbone", "kwargs") and name not in DINO_SMALL | extra}
    torch.manual_seed(0)
    plain = DINO(masked_vit(), **DINO_SMALL, **extra, **defaults)
    assert DINO in preset.__bases__ and type(plain) is DINO
    made.refresh_gram_teacher(0), plain.refresh_gram_teacher(0)  # DINOv3's first snapshot
    assert made.state_dict().keys() == plain.state_dict().keys()
    for key, value in made.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    torch.manual_seed(1)
    loss = made.training_loss(multicrop_views())[0]
    torch.manual_seed(1)
    assert torch.equal(loss, plain.training_loss(multicrop_views())[0])


def test_an_argument_of_a_switched_off_term_is_refused() -> None:
    with pytest.raises(ValueError, match="mask_ratio only apply with patch_distillation=True"):
        DINO(masked_vit(), **DINO_SMALL, mask_ratio=(0.2, 0.4))
    with pytest.raises(ValueError, match="gram_weight only apply with gram_anchoring=True"):
        DINOv2(masked_vit(), **DINO_SMALL, gram_weight=1.0)
