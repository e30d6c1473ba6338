"""Weak views (ReSSL, Zheng et al. 2021, §3.3: random resized crop of scale (0.2, 1) and a flip,
nothing photometric) appended by the per-image recipes (SimCLRViews, MultiCropViews) and the
batched DeviceViews: a flat-coloured image keeps its exact colour in a weak view, while the
strong views (colour jitter p = 1) change it; the weak crops follow the per-sample seeds."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from ssl_lightning.data import DeviceViews, MultiCropViews, SimCLRViews
from ssl_lightning.data.transforms import PRESETS

COLOUR = (200, 40, 90)


def _normalised_colour() -> torch.Tensor:
    p = PRESETS["cifar"]
    return ((torch.tensor(COLOUR) / 255 - torch.tensor(p.mean)) / torch.tensor(p.std))


def _flat(views: list[torch.Tensor], index: int) -> bool:
    want = _normalised_colour().view(3, 1, 1).expand(3, 32, 32)
    return torch.allclose(views[index], want, atol=1e-5)


def test_per_image_recipes_append_weak_views() -> None:
    image = Image.new("RGB", (32, 32), COLOUR)
    torch.manual_seed(0)
    views = SimCLRViews(num_views=1, jitter_p=1.0, weak_views=1)(image)
    assert len(views) == 2 and _flat(views, 1) and not _flat(views, 0)
    crops = MultiCropViews("swav", num_local_crops=2, weak_views=1)
    views = crops(image)
    assert crops.weak_views == 1 and [v.shape[-1] for v in views] == [32, 32, 16, 16, 32]
    assert _flat(views, 4)


def test_device_views_append_seeded_weak_views() -> None:
    images = torch.tensor(COLOUR, dtype=torch.uint8).view(1, 3, 1, 1).expand(4, 3, 32, 32)
    seeds = torch.arange(4, dtype=torch.int64)
    make = DeviceViews(num_views=1, jitter_p=1.0, weak_views=1)
    views = make(images.contiguous(), seeds)
    assert len(views) == 2
    want = _normalised_colour().view(1, 3, 1, 1).expand(4, 3, 32, 32)
    assert torch.allclose(views[1], want, atol=1e-5)
    assert not torch.allclose(views[0], want, atol=1e-3)
    textured = torch.randint(0, 256, (4, 3, 32, 32), generator=torch.Generator().manual_seed(0),
                             dtype=torch.uint8)
    first, again = make(textured, seeds), make(textured, seeds)
    assert torch.equal(first[1], again[1])  # a pure function of the sample seeds
    assert not torch.equal(first[1], make(textured, seeds + 10)[1])


@pytest.mark.parametrize("make", [lambda: SimCLRViews(weak_views=-1),
                                  lambda: MultiCropViews(weak_views=-1),
                                  lambda: DeviceViews(weak_views=-1),
                                  lambda: SimCLRViews(weak_views=1, weak_crop_scale=(0.5, 0.2))])
def test_bad_weak_settings_are_refused(make) -> None:
    with pytest.raises(ValueError, match="weak_views|crop_scale"):
        make()
