"""SimMIM and AIM as methods (float64): the step's loss against references written from the
papers, what the encoders see, the keyed draws, and the errors for bad settings.

Known-bad variants that must fail: SimMIM's ℓ1 over all pixels instead of the masked ones;
SimMIM feeding the masked pixels to the encoder (no mask token); AIM without the prefix-causal
mask (its prediction of a patch sees that patch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mim_utils import GRID, PATCH, SIZE, tiny_aim, tiny_simmim, tiny_vit
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses.mae import normalized_patches, patchify
from ssl_lightning.methods import AIM, SimMIM
from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward

N = GRID * GRID


class _AllPixelsSimMIM(SimMIM):
    """Known-bad: the ℓ1 loss over every patch, visible ones included."""

    def forward_views(self, views: Any) -> dict[str, Any]:
        x = views[0]
        tokens = self.backbone.forward_tokens(x, mask=self.draw_masks(x.shape[0]))
        return {"predictions": self.decoder(tokens[:, 1:]),
                "patches": patchify(x, self.patch_size), "features": tokens[:, 0]}


class _BidirectionalAIM(AIM):
    """Known-bad: no prefix-causal mask, so position k sees patch k + 1 it predicts."""

    def forward_views(self, views: Any) -> dict[str, Any]:
        x = views[0]
        tokens = self.backbone.forward_tokens(x)
        return {"predictions": self.head(tokens[:, 1:-1]), "patches": patchify(x, PATCH),
                "prefix": self.draw_prefix(x.shape[0]), "features": tokens[:, 0]}


def _keys(batch: int, seed: int = 0) -> SampleKeys:
    return SampleKeys.from_seeds(torch.arange(seed, seed + batch, dtype=torch.int64), 7, 0, 1, 0)


def _images(batch: int = 4) -> Tensor:
    return torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


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
    model, x = tiny_simmim().double(), _images()
    with keyed_forward(_keys(4)):
        loss = model.loss_from_outputs(model.forward_views([x]))
        mask = model.draw_masks(4)
    assert mask.shape == (4, N) and (mask.sum(1) == 40).all()  # ceil(0.6 · 16) units of 4
    expected = _simmim_reference(model, x, mask)
    assert abs(loss.item() - expected) < 1e-12
    torch.manual_seed(0)
    bad = _AllPixelsSimMIM(tiny_vit(mask_token=True), mask_patch_size=4, image_size=SIZE).double()
    with keyed_forward(_keys(4)):
        bad_loss = bad.loss_from_outputs(bad.forward_views([x]))
    assert abs(bad_loss.item() - expected) > 1e-3


def test_simmim_encoder_never_sees_the_masked_pixels() -> None:
    torch.manual_seed(0)
    model, x = tiny_simmim().double(), _images()
    with keyed_forward(_keys(4)):
        mask = model.draw_masks(4)
        before = model.forward_views([x])["predictions"]
    pixel_mask = mask.view(4, GRID, 1, GRID, 1).expand(-1, -1, PATCH, -1, PATCH)
    changed = x + 5.0 * pixel_mask.reshape(4, 1, SIZE, SIZE)
    with keyed_forward(_keys(4)):
        after = model.forward_views([changed])["predictions"]
    torch.testing.assert_close(after, before, atol=1e-13, rtol=0)
    # known-bad: without the mask token the encoder reads the masked pixels
    tokens = model.backbone.forward_tokens(x), model.backbone.forward_tokens(changed)
    assert (tokens[1] - tokens[0]).abs().max() > 1e-3


def test_aim_loss_equals_the_reference() -> None:
    torch.manual_seed(0)
    model, x = tiny_aim().double(), _images()
    with keyed_forward(_keys(4)):
        out = model.forward_views([x])
        loss = model.loss_from_outputs(out)
        prefix = model.draw_prefix(4)
    assert torch.equal(out["prefix"], prefix)
    tokens = model.backbone.forward_tokens(x, causal_prefix=prefix)
    pred, target = model.head(tokens[:, 1:]), normalized_patches(patchify(x, PATCH))
    per_image = [float((pred[b, s - 1:N - 1] - target[b, s:]).pow(2).mean())
                 for b, s in enumerate(prefix.tolist())]
    assert abs(loss.item() - sum(per_image) / 4) < 1e-12


def test_aim_prediction_of_a_patch_never_sees_it_and_bidirectional_does() -> None:
    """Changing patch 40 (after every prefix) leaves the predictions of patches <= 40 alone."""
    torch.manual_seed(0)
    x = _images()
    changed = x.clone()
    row, col = divmod(40, GRID)
    changed[:, :, row * PATCH:(row + 1) * PATCH, col * PATCH:(col + 1) * PATCH] += 3.0
    for cls, causal in ((AIM, True), (_BidirectionalAIM, False)):
        torch.manual_seed(0)
        model = cls(tiny_vit(pool="mean"), head_hidden_dim=16, head_layers=2, image_size=SIZE,
                    max_prefix=30).double()
        with keyed_forward(_keys(4)):
            before = model.forward_views([x])["predictions"]
        with keyed_forward(_keys(4)):
            after = model.forward_views([changed])["predictions"]
        gap = (after[:, :40] - before[:, :40]).abs().max().item()  # rows 0..39: patches 1..40
        assert (gap < 1e-13) if causal else (gap > 1e-6), (cls.__name__, gap)


def test_aim_prefixes_are_keyed_uniform_draws_in_range() -> None:
    model = tiny_aim(min_prefix=3, max_prefix=6)
    with keyed_forward(_keys(400)):
        prefix = model.draw_prefix(400)
    assert set(prefix.tolist()) == {3, 4, 5, 6}
    with keyed_forward(_keys(10, seed=395)):  # the same samples in another batch
        assert torch.equal(model.draw_prefix(10)[:5], prefix[395:])


@pytest.mark.parametrize("make, message", [
    (lambda: SimMIM(tiny_vit(), image_size=SIZE), "mask_token=True"),
    (lambda: tiny_simmim(mask_ratio=1.0), r"mask_ratio must be in \(0, 1\)"),
    (lambda: tiny_simmim(mask_ratio=0.0), r"mask_ratio must be in \(0, 1\)"),
    (lambda: tiny_simmim(mask_patch_size=3), "multiple of the ViT's patch_size"),
    (lambda: tiny_simmim(mask_patch_size=6), "must divide the patch grid"),
    (lambda: SimMIM(SmallConvNet(), image_size=SIZE), "needs a ViT backbone"),
    (lambda: tiny_aim(max_prefix=N), "max_prefix .* < the number of patches"),
    (lambda: tiny_aim(min_prefix=0), "1 <= min_prefix"),
    (lambda: tiny_aim(min_prefix=5, max_prefix=4), "min_prefix .5. <= max_prefix .4."),
    (lambda: AIM(tiny_vit(), image_size=32), "image_size 32 must be the backbone's"),
])
def test_bad_settings_fail_with_a_clear_message(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
