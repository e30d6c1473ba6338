"""The asymmetric BYOL view preset: per-view blur and solarisation probabilities."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from ssl_lightning.data import BYOLViews


def _probabilities(pipeline: v2.Compose, op: type) -> list[float]:
    found = []
    for step in pipeline.transforms:
        if isinstance(step, v2.RandomApply) and any(isinstance(t, op) for t in step.transforms):
            found.append(step.p)
        elif isinstance(step, op):
            found.append(getattr(step, "p", 1.0))
    return found


def test_byol_views_are_asymmetric_as_in_the_paper() -> None:
    views = BYOLViews(preset="imagenet")
    assert views.num_views == 2
    first, second = views.transforms
    assert _probabilities(first, v2.GaussianBlur) == [1.0]
    assert _probabilities(second, v2.GaussianBlur) == [0.1]
    assert _probabilities(first, v2.RandomSolarize) == []  # p = 0: not in the pipeline
    assert _probabilities(second, v2.RandomSolarize) == [0.2]


def test_byol_views_output_shapes_and_errors() -> None:
    image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    out = BYOLViews(preset="cifar")(image)
    assert [tuple(v.shape) for v in out] == [(3, 32, 32), (3, 32, 32)]
    assert all(v.dtype == torch.float32 for v in out)
    with pytest.raises(ValueError, match="1.5"):
        BYOLViews(blur_p=(1.5, 0.1))
    with pytest.raises(ValueError, match="2 each"):
        BYOLViews(blur_p=(1.0,))  # type: ignore[arg-type]


def test_byol_views_use_the_papers_colour_jitter() -> None:
    for pipeline in BYOLViews(preset="cifar").transforms:
        jitter = next(
            t for step in pipeline.transforms if isinstance(step, v2.RandomApply)
            for t in step.transforms if isinstance(t, v2.ColorJitter)
        )
        assert jitter.brightness == pytest.approx((0.6, 1.4))
        assert jitter.contrast == pytest.approx((0.6, 1.4))
        assert jitter.saturation == pytest.approx((0.8, 1.2))  # BYOL Table 6: 0.2, not SimCLR's 0.4
        assert jitter.hue == pytest.approx((-0.1, 0.1))
    with pytest.raises(ValueError, match="hue <= 0.5"):
        BYOLViews(jitter=(0.4, 0.4, 0.2, 0.7))
