"""MAE (He et al., CVPR 2022) as a method: the encoder sees only the visible patches, the loss
is the masked-patch MSE against a slow reference, exact resume, LinearEval on its checkpoints
and the errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mim_utils import (
    GRID,
    PATCH,
    SIZE,
    assert_linear_eval_reads_the_checkpoint,
    count_tokens,
    tiny_mae,
    tiny_vit,
)

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MAE


def test_mae_encoder_sees_only_the_visible_patches_and_loss_is_the_masked_patch_mse() -> None:
    torch.manual_seed(0)
    model = tiny_mae()
    x = torch.randn(4, 3, SIZE, SIZE)
    seen = count_tokens(model.backbone.blocks[0])
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


def test_linear_eval_reads_its_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(0)
    assert_linear_eval_reads_the_checkpoint(tiny_mae(), "backbone.", "cls", tmp_path)


def test_bad_input_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match="needs a ViT backbone .* got SmallConvNet"):
        MAE(SmallConvNet((8, 16)), image_size=SIZE)
    with pytest.raises(ValueError, match="image_size 32 must be the backbone's image size 16"):
        MAE(tiny_vit(), image_size=32)
    for ratio in (0.0, 1.0, 1.2):
        with pytest.raises(ValueError, match="mask_ratio"):
            tiny_mae(mask_ratio=ratio)
    with pytest.raises(ValueError, match="expects views of 16x16 px"):
        tiny_mae().forward_views([torch.randn(2, 3, 32, 32)])
