"""Per-step crop sizes: drawn from the rank-free step seed with the given ratios, the views
resized to them, and DINOv3 training on them."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from ssl_lightning.backbones import ViT
from ssl_lightning.data import GramCropViews, ImageFolderDataModule
from ssl_lightning.methods import DINOv3
from ssl_lightning.training.mixed_resolution import MixedResolution
from ssl_lightning.training.step_rng import step_seed

SIZES = [[16, 8, 32], [12, 8, 24], [8, 4, 16]]


def test_draws_follow_the_ratios_and_the_seed():
    mixed = MixedResolution(SIZES, [0.5, 0.5, 0.0])
    draws = [mixed.draw(s) for s in range(400)]
    assert draws == [mixed.draw(s) for s in range(400)]  # a pure function of the seed
    assert (8, 4, 16) not in draws
    share = draws.count((16, 8, 32)) / len(draws)
    assert 0.4 < share < 0.6


def test_views_are_resized_to_the_step_sizes():
    views = [torch.randn(2, 3, s, s) for s in (16, 16, 8, 32, 32)]
    out = MixedResolution.resize(views, 1, (12, 8, 24))
    assert [v.shape[-1] for v in out] == [12, 12, 8, 24, 24]
    assert out[2] is views[2]
    want = F.interpolate(views[0], size=(12, 12), mode="bicubic", antialias=True)
    torch.testing.assert_close(out[0], want)
    with pytest.raises(ValueError, match="largest mixed_resolution size"):
        MixedResolution.resize(views, 1, (20, 8, 24))
    with pytest.raises(ValueError, match="ratios"):
        MixedResolution(SIZES, [1.0])


def test_dinov3_trains_on_the_sizes_of_the_step_the_same_on_every_rank():
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=2, mask_token=True)
    model = DINOv3(vit, head_out_dim=8, patch_out_dim=8, head_hidden_dim=8,
                   head_bottleneck_dim=4, patch_hidden_dim=8, patch_bottleneck_dim=4,
                   num_local_crops=1, warmup_teacher_temperature_epochs=0, rng_seed=3,
                   mixed_resolution_sizes=SIZES)
    seen = []
    model.backbone.patch_embed.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].shape[-1]))
    for batch_idx in range(6):
        model.on_train_batch_start(None, batch_idx)
        expected = model.mixed_resolution.draw(step_seed(3, 0, batch_idx, 0))
        assert model.step_sizes == expected
        seen.clear()
        views = [torch.randn(2, 3, s, s) for s in (16, 16, 8, 32, 32)]
        loss, _ = model.training_loss(views)
        assert torch.isfinite(loss) and set(seen) == set(expected[:2])
    # The seed has no rank (every rank draws these sizes); the steps differ.
    assert len({model.mixed_resolution.draw(step_seed(3, 0, b, 0)) for b in range(20)}) > 1


def test_sizes_are_checked_before_training(tiny_image_folder):
    """An empty list, a side off the patch grid (the nearest valid sides named) and a size
    above the data's crops (refused in on_fit_start, before the first step)."""
    with pytest.raises(ValueError, match=r"non-empty list .* leave it unset"):
        MixedResolution([])
    with pytest.raises(ValueError, match=r"local side 10 of \[16, 10, 32\] is not a multiple of "
                                         r"the ViT's patch size 4; the nearest valid sides are "
                                         r"8 and 12"):
        MixedResolution([[16, 8, 32], [16, 10, 32]], patch_size=4)
    with pytest.raises(ValueError, match="nearest valid sides are 4.$"):
        MixedResolution([[3, 4, 8]], patch_size=4)
    MixedResolution(SIZES).check_crops([16, 8, None])  # no Gram crops: the gram side unused
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=2, mask_token=True)
    with pytest.raises(ValueError, match="patch size 4"):
        DINOv3(vit, num_local_crops=1, mixed_resolution_sizes=[[16, 6, 32]])
    model = DINOv3(vit, head_out_dim=8, patch_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4,
                   patch_hidden_dim=8, patch_bottleneck_dim=4, num_local_crops=1,
                   mixed_resolution_sizes=SIZES, image_size=16, lr_scaling="none")
    data = ImageFolderDataModule(str(tiny_image_folder / "train"), batch_size=4, num_workers=0,
                                 train_transform=GramCropViews(gram_size=24, global_size=16,
                                                               num_local_crops=1, local_size=8))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(ValueError, match=r"gram crops of 32 px but the data's train_transform "
                                         r"makes 24 px ones .* set its gram_size to 32"):
        trainer.fit(model, data)
    assert trainer.global_step == 0


@pytest.mark.parametrize("ratios", [[float("nan"), 1.0, 1.0], [float("inf"), 1.0, 0.0],
                                    [1.0, -0.5, 1.0]])
def test_non_finite_or_negative_ratios_are_refused_when_constructed(ratios):
    """NaN and inf ratios used to pass and crash the first step in torch.multinomial."""
    with pytest.raises(ValueError, match=r"mixed_resolution_ratios must be 3 finite, "
                                         r"non-negative values .* got \["):
        MixedResolution(SIZES, ratios)
