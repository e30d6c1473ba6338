"""SimMIM (Xie et al., CVPR 2022) as a method (float64): the step's loss against a reference
written from the paper, the encoder never sees the masked pixels, and the errors for bad
settings. Known-bad variants that must fail: the ℓ1 over all pixels instead of the masked ones;
the masked pixels fed to the encoder (no mask token)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mim_utils import (
    GRID,
    PATCH,
    SIZE,
    float64_images,
    sample_keys,
    tiny_simmim,
    tiny_vit,
)
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses.mae import patchify
from ssl_lightning.methods import SimMIM
from ssl_lightning.training.sample_rng import keyed_forward

N = GRID * GRID


class _AllPixelsSimMIM(SimMIM):
    """Known-bad: the ℓ1 loss over every patch, visible ones included."""

    def forward_views(self, views: Any) -> dict[str, Any]:
        x = views[0]
        tokens = self.backbone.forward_tokens(x, mask=self.draw_masks(x.shape[0]))
        return {"predictions": self.decoder(tokens[:, 1:]),
                "patches": patchify(x, self.patch_size), "features": tokens[:, 0]}


def _simmim_reference(model: SimMIM, x: Tensor, mask: Tensor) -> float:
    """Xie et al. eq. 1: masked patches replaced by the mask token before the position
    embedding, a linear map of each output token to its patch's pixels, mean |y − x| over the
    masked pixels."""
    vit = model.backbone
    with torch.no_grad():
        tokens = vit.patch_embed(x).flatten(2).transpose(1, 2)
        tokens = torch.where(mask.unsqueeze(-1), vit.mask_token, tokens) + vit.pos_embed[:, 1:]
        tokens = torch.cat([(vit.cls_token + vit.pos_embed[:, :1]).expand(len(x), -1, -1),
                            tokens], dim=1)
        for block in vit.blocks:
            tokens = block(tokens)
        pred = model.decoder(vit.norm(tokens)[:, 1:])
    target = patchify(x, PATCH)
    total, count = 0.0, 0
    for b in range(len(x)):
        for j in range(N):
            if mask[b, j]:
                total += float((pred[b, j] - target[b, j]).abs().sum())
                count += target.shape[-1]
    return total / count


def test_simmim_loss_equals_the_reference_and_all_pixels_differs() -> None:
    torch.manual_seed(0)
    model, x = tiny_simmim().double(), float64_images()
    with keyed_forward(sample_keys(4)):
        loss = model.loss_from_outputs(model.forward_views([x]))
        mask = model.draw_masks(4)
    assert mask.shape == (4, N) and (mask.sum(1) == 40).all()  # ceil(0.6 · 16) units of 4
    expected = _simmim_reference(model, x, mask)
    assert abs(loss.item() - expected) < 1e-12
    torch.manual_seed(0)
    bad = _AllPixelsSimMIM(tiny_vit(mask_token=True), mask_patch_size=4, image_size=SIZE).double()
    with keyed_forward(sample_keys(4)):
        bad_loss = bad.loss_from_outputs(bad.forward_views([x]))
    assert abs(bad_loss.item() - expected) > 1e-3


def test_simmim_encoder_never_sees_the_masked_pixels() -> None:
    torch.manual_seed(0)
    model, x = tiny_simmim().double(), float64_images()
    with keyed_forward(sample_keys(4)):
        mask = model.draw_masks(4)
        before = model.forward_views([x])["predictions"]
    pixel_mask = mask.view(4, GRID, 1, GRID, 1).expand(-1, -1, PATCH, -1, PATCH)
    changed = x + 5.0 * pixel_mask.reshape(4, 1, SIZE, SIZE)
    with keyed_forward(sample_keys(4)):
        after = model.forward_views([changed])["predictions"]
    torch.testing.assert_close(after, before, atol=1e-13, rtol=0)
    # known-bad: without the mask token the encoder reads the masked pixels
    tokens = model.backbone.forward_tokens(x), model.backbone.forward_tokens(changed)
    assert (tokens[1] - tokens[0]).abs().max() > 1e-3


@pytest.mark.parametrize("make, message", [
    (lambda: SimMIM(tiny_vit(), image_size=SIZE), "mask_token=True"),
    (lambda: tiny_simmim(mask_ratio=1.0), r"mask_ratio must be in \(0, 1\)"),
    (lambda: tiny_simmim(mask_ratio=0.0), r"mask_ratio must be in \(0, 1\)"),
    (lambda: tiny_simmim(mask_patch_size=3), "multiple of the ViT's patch_size"),
    (lambda: tiny_simmim(mask_patch_size=6), "must divide the patch grid"),
    (lambda: SimMIM(SmallConvNet(), image_size=SIZE), "needs a ViT backbone"),
])
def test_bad_settings_fail_with_a_clear_message(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
