"""iBOT / DINOv2 methods: the student's masked patches receive the mask token, per-sample
outputs of forward_views, heads and teachers, the frozen last layers, bad input before training,
and exact resume (centres, teachers, schedules, masks, frozen last layers)."""

from __future__ import annotations

import inspect

import pytest
import pytorch_lightning as pl
import torch
from momentum_utils import cpu_trainer, fit_and_resume
from multicrop_utils import multicrop_loader

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.data import MultiCropViews
from ssl_lightning.methods import DINO, IBOT, DINOv2, DINOv3

SMALL = dict(head_out_dim=32, head_hidden_dim=16, head_bottleneck_dim=8, optimizer="adamw",
             lr=1e-3, lr_scaling="none", warmup_epochs=0, weight_decay=0.04,
             warmup_teacher_temperature_epochs=1, freeze_last_layer_epochs=1)


def tiny_vit(depth: int = 2, **kwargs) -> ViT:
    return ViT(image_size=16, patch_size=4, embed_dim=16, depth=depth, num_heads=2,
               mask_token=True, **kwargs)


def views(batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 3, s, s, generator=g) for s in (16, 16, 8, 8)]


def test_masked_positions_receive_the_mask_token_teacher_sees_clean_crops():
    torch.manual_seed(0)
    model = DINOv2(tiny_vit(num_registers=2), **SMALL, patch_out_dim=24, num_local_crops=2,
                   mask_probability=1.0)
    seen: dict[str, list[torch.Tensor]] = {"student": [], "teacher": []}
    for name, vit in (("student", model.backbone), ("teacher", model.teacher_backbone)):
        vit.blocks[0].register_forward_pre_hook(
            lambda module, args, name=name: seen[name].append(args[0].detach()))
    x = views()
    outputs = model.forward_views(x)
    masks = outputs["masks"]  # (B, 2, N)
    assert masks.shape == (4, 2, 16) and masks.any() and not masks.all()
    tokens = seen["student"][0][:, 3:]  # 2B global crops, after [CLS] + 2 registers
    flat = masks.transpose(0, 1).flatten(0, 1)
    vit = model.backbone
    pos = vit.pos_embed[:, 1:]
    patches = vit.patch_embed(torch.cat(x[:2])).flatten(2).transpose(1, 2)
    expected = torch.where(flat.unsqueeze(-1), vit.mask_token, patches) + pos
    torch.testing.assert_close(tokens, expected)
    teacher = model.teacher_backbone
    clean = teacher.patch_embed(torch.cat(x[:2])).flatten(2).transpose(1, 2) + pos
    torch.testing.assert_close(seen["teacher"][0][:, 3:], clean)
    assert len(seen["teacher"]) == 1  # teacher: the 2 global crops, in one call
    # Per-sample outputs, batch in dim 0; separate heads with their own sizes.
    shapes = {k: tuple(v.shape) for k, v in outputs.items()}
    assert shapes == {"student_cls": (4, 4, 32), "teacher_cls": (4, 2, 32),
                      "student_patch": (4, 2, 16, 24), "teacher_patch": (4, 2, 16, 24),
                      "masks": (4, 2, 16), "global_features": (4, 2, 16), "features": (4, 16),
                      "patch_tokens": (4, 2, 16, 16)}
    assert not outputs["teacher_patch"].requires_grad
    torch.testing.assert_close(outputs["features"], outputs["global_features"][:, 0])
    loss = model.loss_from_outputs(outputs)
    loss.backward()
    assert vit.mask_token.grad is not None and vit.mask_token.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.teacher_backbone.parameters())
    pairs = model.ema_pairs()
    assert (model.patch_head, model.teacher_patch_head) in pairs and len(pairs) == 3


def test_shared_head_masks_follow_the_rng_and_patch_temperature_warmup():
    torch.manual_seed(0)
    model = IBOT(tiny_vit(), **SMALL, warmup_patch_teacher_temperature=0.03,
                 patch_teacher_temperature=0.05)
    assert model.patch_head is None and len(model.ema_pairs()) == 2
    assert [model.patch_teacher_temperature(e) for e in (0, 1, 2)] == pytest.approx(
        [0.03, 0.05, 0.05])
    torch.manual_seed(3)
    first = model.forward_views(views())
    torch.manual_seed(3)
    again = model.forward_views(views())
    assert torch.equal(first["masks"], again["masks"])
    torch.testing.assert_close(first["student_patch"], again["student_patch"])
    # The shared head: patch logits are the [CLS] head applied to the patch tokens.
    assert first["student_patch"].shape[-1] == first["student_cls"].shape[-1] == 32


def test_frozen_last_layers_of_both_heads():
    model = DINOv2(tiny_vit(), **{**SMALL, "freeze_last_layer_epochs": 2}, clip_grad=None)
    for p in model.trainable_parameters():
        p.grad = torch.ones_like(p)
    model.adjust_gradients_(epoch=1)
    assert model.head.last_layer_v.grad is None and model.patch_head.last_layer_v.grad is None
    assert model.patch_head.mlp[0].weight.grad is not None
    for p in model.trainable_parameters():
        p.grad = torch.ones_like(p)
    model.adjust_gradients_(epoch=2)
    assert model.patch_head.last_layer_v.grad is not None


@pytest.mark.parametrize(
    "make, match",
    [(lambda: IBOT(SmallConvNet((8, 16)), **SMALL), "ViT backbone"),
     (lambda: IBOT(ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2),
                   **SMALL), "mask_token=True"),
     (lambda: IBOT(tiny_vit(), **SMALL, mask_ratio=(0.2, 1.5)), "mask_ratio must satisfy"),
     (lambda: IBOT(tiny_vit(), **SMALL, mask_probability=-0.1), "probability"),
     (lambda: IBOT(tiny_vit(), **SMALL, patch_out_dim=64), "patch_out_dim"),
     (lambda: IBOT(tiny_vit(), **SMALL, head_batch_norm=True), "head_batch_norm"),
     (lambda: IBOT(tiny_vit(), **SMALL, centering="mean"), "centering"),
     (lambda: DINOv2(tiny_vit(), **SMALL, num_local_crops=0), "num_local_crops"),
     (lambda: DINOv2(tiny_vit(), **SMALL, koleo_scope="gpu"), "koleo_scope"),
     (lambda: DINOv2(tiny_vit(), **SMALL, koleo_weight=-1.0), "koleo_weight")],
)
def test_bad_arguments_fail_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


class MultiCropData(pl.LightningDataModule):
    """The tiny multi-crop loader behind a data module that declares its transform."""

    def __init__(self) -> None:
        super().__init__()
        self.train_transform = MultiCropViews(num_local_crops=2)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return multicrop_loader()


def test_missing_local_crops_fail_before_training(tmp_path):
    model = DINOv2(tiny_vit(), **SMALL, num_local_crops=6)
    with pytest.raises(ValueError, match="2 \\+ 6 views, got 4"):
        model.forward_views(views())
    initial = model.head.mlp[0].weight.detach().clone()
    with pytest.raises(ValueError, match="num_local_crops=6 but the data's train_transform"):
        cpu_trainer(str(tmp_path), 1, enable_checkpointing=False).fit(model, MultiCropData())
    assert torch.equal(model.head.mlp[0].weight, initial)  # no optimiser step was taken


def test_exact_resume_centres_teachers_schedules_and_masks(tmp_path):
    def make():
        return DINOv2(tiny_vit(depth=1, drop_path_rate=0.1), **SMALL, centering="center",
                      patch_out_dim=24, num_local_crops=2, weight_decay_end=0.4)

    # 2 steps per epoch.
    full, resumed = fit_and_resume(make, lambda: multicrop_loader(8), str(tmp_path))
    assert full.keys() == resumed.keys()
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key
    assert full["criterion.center"].abs().sum() > 0
    assert full["patch_criterion.center"].abs().sum() > 0
    torch.manual_seed(0)
    assert not torch.equal(full["patch_head.last_layer_v"], make().patch_head.last_layer_v)


@pytest.mark.parametrize("preset", [IBOT, DINOv2, DINOv3])
def test_presets_are_dino_with_their_defaults(preset: type[DINO]) -> None:
    """A preset is DINO with its defaults passed explicitly: the same modules, weights, loss."""
    extra: dict = dict(num_local_crops=2)
    if preset is DINOv3:
        extra.update(patch_hidden_dim=12, patch_bottleneck_dim=6, patch_out_dim=24)
    torch.manual_seed(0)
    made = preset(tiny_vit(), **SMALL, **extra)
    defaults = {name: parameter.default
                for name, parameter in inspect.signature(preset.__init__).parameters.items()
                if name not in ("self", "backbone", "kwargs") and name not in SMALL | extra}
    torch.manual_seed(0)
    plain = DINO(tiny_vit(), **SMALL, **extra, **defaults)
    assert DINO in preset.__bases__ and type(plain) is DINO
    made.refresh_gram_teacher(0), plain.refresh_gram_teacher(0)  # DINOv3's first snapshot
    assert made.state_dict().keys() == plain.state_dict().keys()
    for key, value in made.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    torch.manual_seed(1)
    loss = made.training_loss(views())[0]
    torch.manual_seed(1)
    assert torch.equal(loss, plain.training_loss(views())[0])


def test_an_argument_of_a_switched_off_term_is_refused() -> None:
    with pytest.raises(ValueError, match="mask_ratio only apply with patch_distillation=True"):
        DINO(tiny_vit(), **SMALL, mask_ratio=(0.2, 0.4))
    with pytest.raises(ValueError, match="gram_weight only apply with gram_anchoring=True"):
        DINOv2(tiny_vit(), **SMALL, gram_weight=1.0)
