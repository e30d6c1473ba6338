"""iBOT (Zhou et al., ICLR 2022) and iBOT++ (its visible-patch term): the shared head's masks
follow the RNG and the patch temperature warms up; bad arguments fail at construction; iBOT++
trained on 2 processes equals one process fed the global batch in the sampler's order (the
registry's property checks iBOT itself, ``tests/properties/test_ddp_equals_one_process.py``)."""

from __future__ import annotations

import pytest
import torch
from multicrop_utils import DINO_SMALL, masked_vit, multicrop_views

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.methods import IBOT
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import KeyedViews, assert_two_processes_equal_one

OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)


def _ibot_plus_plus() -> IBOT:
    return method_entry("ibot").small(patch_visible_weight=0.5, **OPTIM)


@pytest.mark.slow
def test_ibot_plus_plus_on_two_processes_equals_one_process() -> None:
    assert_two_processes_equal_one(_ibot_plus_plus, KeyedViews(24, method_entry("ibot").views))


def test_shared_head_masks_follow_the_rng_and_patch_temperature_warmup():
    torch.manual_seed(0)
    model = IBOT(masked_vit(), **DINO_SMALL, warmup_patch_teacher_temperature=0.03,
                 patch_teacher_temperature=0.05)
    assert model.patch_head is None and len(model.ema_pairs()) == 2
    assert [model.patch_teacher_temperature(e) for e in (0, 1, 2)] == pytest.approx(
        [0.03, 0.05, 0.05])
    torch.manual_seed(3)
    first = model.forward_views(multicrop_views())
    torch.manual_seed(3)
    again = model.forward_views(multicrop_views())
    assert torch.equal(first["masks"], again["masks"])
    torch.testing.assert_close(first["student_patch"], again["student_patch"])
    # The shared head: patch logits are the [CLS] head applied to the patch tokens.
    assert first["student_patch"].shape[-1] == first["student_cls"].shape[-1] == 32


@pytest.mark.parametrize(
    "make, match",
    [(lambda: IBOT(SmallConvNet((8, 16)), **DINO_SMALL), "ViT backbone"),
     (lambda: IBOT(ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2),
                   **DINO_SMALL), "mask_token=True"),
     (lambda: IBOT(masked_vit(), **DINO_SMALL, mask_ratio=(0.2, 1.5)), "mask_ratio must satisfy"),
     (lambda: IBOT(masked_vit(), **DINO_SMALL, mask_probability=-0.1), "probability"),
     (lambda: IBOT(masked_vit(), **DINO_SMALL, patch_out_dim=64), "patch_out_dim"),
     (lambda: IBOT(masked_vit(), **DINO_SMALL, head_batch_norm=True), "head_batch_norm"),
     (lambda: IBOT(masked_vit(), **DINO_SMALL, centering="mean"), "centering")],
)
def test_bad_arguments_fail_at_construction(make, match):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make()
