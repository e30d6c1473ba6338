"""Multi-crop views (shapes, resolutions, order) and the once-per-resolution forward helper."""

from __future__ import annotations

import pytest
import torch
from multicrop_utils import CountingModule
from PIL import Image
from torch import nn

from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.data import MultiCropViews, MultiViewTransform
from ssl_lightning.data.multicrop import RECIPES


@pytest.fixture(scope="module")
def image() -> Image.Image:
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (40, 48, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.mark.parametrize(
    ("recipe", "dataset", "sizes", "n_local"),
    [("dino", "cifar", (32, 16), 10), ("swav", "cifar", (32, 16), 6),
     ("dino", "imagenet", (224, 96), 10), ("swav", "imagenet", (224, 96), 6)],
)
def test_views_have_recipe_shapes_in_global_then_local_order(image, recipe, dataset, sizes,
                                                             n_local):
    transform = MultiCropViews(recipe, dataset)
    assert isinstance(transform, MultiViewTransform)
    views = transform(image)
    assert transform.num_views == len(views) == 2 + n_local
    assert [v.shape for v in views] == [(3, sizes[0], sizes[0])] * 2 + [(3, sizes[1],
                                                                         sizes[1])] * n_local
    assert all(v.dtype == torch.float32 for v in views)


def test_recipe_scales_and_overrides(image):
    dino = MultiCropViews("dino", "imagenet")
    crops = [t.transforms[0] for t in dino.transforms]
    assert crops[0].scale == crops[1].scale == (0.4, 1.0) == RECIPES["dino"].global_scale
    assert crops[2].scale == (0.05, 0.4)
    swav = MultiCropViews("swav", "imagenet")
    assert [t.transforms[0].scale for t in swav.transforms[1:3]] == [(0.14, 1.0), (0.05, 0.14)]
    custom = MultiCropViews("swav", "cifar", num_local_crops=3, global_size=24, local_size=8,
                            local_scale=(0.1, 0.2))
    views = custom(image)
    assert [v.shape[-1] for v in views] == [24, 24, 8, 8, 8]
    assert custom.transforms[2].transforms[0].scale == (0.1, 0.2)
    assert len(MultiCropViews(num_local_crops=0)(image)) == 2


def test_dino_global_crops_are_asymmetric():
    text = repr(MultiCropViews("dino", "imagenet"))
    first, second = text.split("view 1:")[0], text.split("view 1:")[1].split("view 2:")[0]
    assert "GaussianBlur" in first and "RandomSolarize" not in first
    assert "RandomSolarize" in second


@pytest.mark.parametrize("kwargs", [dict(recipe="byol"), dict(dataset="stl"),
                                    dict(num_local_crops=-1)])
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        MultiCropViews(**kwargs)


def test_forward_by_resolution_one_call_per_group_and_same_outputs():
    torch.manual_seed(0)
    net = CountingModule(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()))
    # Interleaved resolutions are grouped too, and outputs come back in view order.
    views = [torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4),
             torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4)]
    out = forward_by_resolution(net, views)
    assert net.calls == [(6, 3, 8, 8), (4, 3, 4, 4)]
    expected = torch.cat([net.module(v) for v in views])
    torch.testing.assert_close(out, expected)
    net.calls.clear()
    forward_by_resolution(net, views[:1])
    assert net.calls == [(2, 3, 8, 8)]


def test_forward_by_resolution_keeps_gradients():
    net = nn.Linear(4, 2)
    views = [torch.randn(3, 4), torch.randn(3, 4)]
    forward_by_resolution(net, views).sum().backward()
    assert net.weight.grad is not None
    with pytest.raises(ValueError):
        forward_by_resolution(net, [])
