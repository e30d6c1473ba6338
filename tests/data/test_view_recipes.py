"""View recipes against their sources: DINO (paper appendix and official DataAugmentationDINO),
SwAV (official multicropdataset.py), BYOL on CIFAR (solo-learn's asymmetric.yaml)."""

from __future__ import annotations

import pytest
from torchvision.transforms import v2

from ssl_lightning.data import BYOLViews, MultiCropViews


def _ops(pipeline: v2.Compose, op: type) -> list:
    found = []
    for step in pipeline.transforms:
        inner = step.transforms if isinstance(step, v2.RandomApply) else [step]
        found += [(t, getattr(step, "p", 1.0)) for t in inner if isinstance(t, op)]
    return found


@pytest.mark.parametrize(("recipe", "jitter", "interpolation"), [
    ("dino", (0.4, 0.4, 0.2, 0.1), v2.InterpolationMode.BICUBIC),
    ("swav", (0.8, 0.8, 0.8, 0.2), v2.InterpolationMode.BILINEAR),
])
def test_multicrop_jitter_and_interpolation_follow_the_official_code(recipe, jitter,
                                                                    interpolation):
    for pipeline in MultiCropViews(recipe, "imagenet", num_local_crops=1).transforms:
        (color, p), = _ops(pipeline, v2.ColorJitter)
        brightness, contrast, saturation, hue = jitter
        assert p == 0.8 and color.brightness == pytest.approx((1 - brightness, 1 + brightness))
        assert color.contrast == pytest.approx((1 - contrast, 1 + contrast))
        assert color.saturation == pytest.approx((1 - saturation, 1 + saturation))  # DINO: 0.2
        assert color.hue == pytest.approx((-hue, hue))
        (crop, _), = _ops(pipeline, v2.RandomResizedCrop)
        assert v2.InterpolationMode(crop.interpolation) == interpolation  # DINO: bicubic


def test_multicrop_deviation_is_an_argument():
    views = MultiCropViews("dino", "cifar", num_local_crops=0, jitter=(0.4, 0.4, 0.4, 0.1),
                           interpolation="bilinear")
    (color, _), = _ops(views.transforms[0], v2.ColorJitter)
    (crop, _), = _ops(views.transforms[0], v2.RandomResizedCrop)
    assert color.saturation == pytest.approx((0.6, 1.4))
    assert v2.InterpolationMode(crop.interpolation) == v2.InterpolationMode.BILINEAR


def test_byol_cifar_preset_drops_the_blur_imagenet_keeps_the_papers():
    cifar = BYOLViews("cifar").transforms
    assert [_ops(p, v2.GaussianBlur) for p in cifar] == [[], []]  # was a 3x3 blur at p = 1.0
    assert [[p for _, p in _ops(t, v2.RandomSolarize)] for t in cifar] == [[], [0.2]]
    imagenet = BYOLViews("imagenet").transforms
    assert [[p for _, p in _ops(t, v2.GaussianBlur)] for t in imagenet] == [[1.0], [0.1]]
    explicit = BYOLViews("cifar", blur_p=(1.0, 0.1)).transforms
    assert [[p for _, p in _ops(t, v2.GaussianBlur)] for t in explicit] == [[1.0], [0.1]]
