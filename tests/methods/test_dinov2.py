"""DINOv2 (Oquab et al. 2023): the student's masked patches receive the mask token, per-sample
outputs of forward_views, heads and teachers, the frozen last layers of both heads, bad input
before training, and exact resume (centres, teachers, schedules, masks, frozen last layers)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from momentum_utils import cpu_trainer, fit_and_resume
from multicrop_utils import DINO_SMALL, masked_vit, multicrop_loader, multicrop_views

from ssl_lightning.data import MultiCropViews
from ssl_lightning.methods import DINOv2


def test_masked_positions_receive_the_mask_token_teacher_sees_clean_crops():
    torch.manual_seed(0)
    model = DINOv2(masked_vit(num_registers=2), **DINO_SMALL, patch_out_dim=24, num_local_crops=2,
                   mask_probability=1.0)
    seen: dict[str, list[torch.Tensor]] = {"student": [], "teacher": []}
    for name, vit in (("student", model.backbone), ("teacher", model.teacher_backbone)):
        vit.blocks[0].register_forward_pre_hook(
            lambda module, args, name=name: seen[name].append(args[0].detach()))
    x = multicrop_views()
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


def test_frozen_last_layers_of_both_heads():
    model = DINOv2(masked_vit(), **{**DINO_SMALL, "freeze_last_layer_epochs": 2}, clip_grad=None)
    for p in model.trainable_parameters():
        p.grad = torch.ones_like(p)
    model.adjust_gradients_(epoch=1)
    assert model.head.last_layer_v.grad is None and model.patch_head.last_layer_v.grad is None
    assert model.patch_head.mlp[0].weight.grad is not None
    for p in model.trainable_parameters():
        p.grad = torch.ones_like(p)
    model.adjust_gradients_(epoch=2)
    assert model.patch_head.last_layer_v.grad is not None


class MultiCropData(pl.LightningDataModule):
    """The tiny multi-crop loader behind a data module that declares its transform."""

    def __init__(self) -> None:
        super().__init__()
        self.train_transform = MultiCropViews(num_local_crops=2)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return multicrop_loader()


def test_missing_local_crops_fail_before_training(tmp_path):
    model = DINOv2(masked_vit(), **DINO_SMALL, num_local_crops=6)
    with pytest.raises(ValueError, match="2 \\+ 6 views, got 4"):
        model.forward_views(multicrop_views())
    initial = model.head.mlp[0].weight.detach().clone()
    with pytest.raises(ValueError, match="num_local_crops=6 but the data's train_transform"):
        cpu_trainer(str(tmp_path), 1, enable_checkpointing=False).fit(model, MultiCropData())
    assert torch.equal(model.head.mlp[0].weight, initial)  # no optimiser step was taken


def test_exact_resume_centres_teachers_schedules_and_masks(tmp_path):
    def make():
        return DINOv2(masked_vit(depth=1, drop_path_rate=0.1), **DINO_SMALL, centering="center",
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


@pytest.mark.parametrize(
    "make, match",
    [(lambda: DINOv2(masked_vit(), **DINO_SMALL, num_local_crops=0), "num_local_crops"),
     (lambda: DINOv2(masked_vit(), **DINO_SMALL, koleo_scope="gpu"), "koleo_scope"),
     (lambda: DINOv2(masked_vit(), **DINO_SMALL, koleo_weight=-1.0), "koleo_weight")],
)
def test_bad_arguments_fail_at_construction(make, match):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make()
