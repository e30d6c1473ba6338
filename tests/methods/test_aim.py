"""AIM (El-Nouby et al., ICML 2024) as a method (float64): the step's loss against a reference
written from the paper, the prefix-causal attention (the prediction of a patch never sees it),
the keyed prefix draws, and the errors for bad settings. Known-bad variant that must fail: AIM
without the prefix-causal mask (its prediction of a patch sees that patch)."""

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
    tiny_aim,
    tiny_vit,
)

from ssl_lightning.losses.mae import normalized_patches, patchify
from ssl_lightning.methods import AIM
from ssl_lightning.training.sample_rng import keyed_forward

N = GRID * GRID


class _BidirectionalAIM(AIM):
    """Known-bad: no prefix-causal mask, so position k sees patch k + 1 it predicts."""

    def forward_views(self, views: Any) -> dict[str, Any]:
        x = views[0]
        tokens = self.backbone.forward_tokens(x)
        return {"predictions": self.head(tokens[:, 1:-1]), "patches": patchify(x, PATCH),
                "prefix": self.draw_prefix(x.shape[0]), "features": tokens[:, 0]}


def test_aim_loss_equals_the_reference() -> None:
    torch.manual_seed(0)
    model, x = tiny_aim().double(), float64_images()
    with keyed_forward(sample_keys(4)):
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
    x = float64_images()
    changed = x.clone()
    row, col = divmod(40, GRID)
    changed[:, :, row * PATCH:(row + 1) * PATCH, col * PATCH:(col + 1) * PATCH] += 3.0
    for cls, causal in ((AIM, True), (_BidirectionalAIM, False)):
        torch.manual_seed(0)
        model = cls(tiny_vit(pool="mean"), head_hidden_dim=16, head_layers=2, image_size=SIZE,
                    max_prefix=30).double()
        with keyed_forward(sample_keys(4)):
            before = model.forward_views([x])["predictions"]
        with keyed_forward(sample_keys(4)):
            after = model.forward_views([changed])["predictions"]
        gap = (after[:, :40] - before[:, :40]).abs().max().item()  # rows 0..39: patches 1..40
        assert (gap < 1e-13) if causal else (gap > 1e-6), (cls.__name__, gap)


def test_aim_prefixes_are_keyed_uniform_draws_in_range() -> None:
    model = tiny_aim(min_prefix=3, max_prefix=6)
    with keyed_forward(sample_keys(400)):
        prefix = model.draw_prefix(400)
    assert set(prefix.tolist()) == {3, 4, 5, 6}
    with keyed_forward(sample_keys(10, seed=395)):  # the same samples in another batch
        assert torch.equal(model.draw_prefix(10)[:5], prefix[395:])


@pytest.mark.parametrize("make, message", [
    (lambda: tiny_aim(max_prefix=N), "max_prefix .* < the number of patches"),
    (lambda: tiny_aim(min_prefix=0), "1 <= min_prefix"),
    (lambda: tiny_aim(min_prefix=5, max_prefix=4), "min_prefix .5. <= max_prefix .4."),
    (lambda: AIM(tiny_vit(), image_size=32), "image_size 32 must be the backbone's"),
])
def test_bad_settings_fail_with_a_clear_message(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
