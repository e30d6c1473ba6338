"""View transforms: view count, shapes, dtype, exact normalisation, presets, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from ssl_lightning.data import EvalTransform, LinearEvalTransform, MultiViewTransform, SimCLRViews
from ssl_lightning.data.transforms import PRESETS

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465])
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616])


def _image(size: tuple[int, int] = (32, 32), seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3))
    return Image.fromarray(pixels.astype(np.uint8))


def _normalized(image: Image.Image, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """Reference: (pixels / 255 - mean) / std, channels first, written from the definition."""
    x = np.asarray(image, dtype=np.float64) / 255.0
    return torch.from_numpy(((x - mean) / std).transpose(2, 0, 1)).float()


def _steps(transform: MultiViewTransform, view: int = 0) -> list[object]:
    """The flat list of steps of one view pipeline (unwrapping RandomApply)."""
    flat = []
    for step in transform.transforms[view].transforms:
        flat += list(step.transforms) if isinstance(step, v2.RandomApply) else [step]
    return flat


def test_simclr_views_count_shape_dtype_and_views_differ() -> None:
    torch.manual_seed(0)
    views = SimCLRViews("cifar", num_views=3)(_image())
    assert len(views) == 3
    for view in views:
        assert view.shape == (3, 32, 32) and view.dtype == torch.float32
    assert not torch.equal(views[0], views[1]) and not torch.equal(views[1], views[2])


def test_simclr_views_without_randomness_equal_exact_normalisation() -> None:
    # Full-image crop, no colour ops: each view is the normalised image or its mirror image.
    image = _image(seed=1)
    transform = SimCLRViews("cifar", crop_scale=(1.0, 1.0), jitter_p=0.0, grayscale_p=0.0)
    expected = _normalized(image, CIFAR_MEAN, CIFAR_STD)
    for view in transform(image):
        assert (torch.allclose(view, expected, atol=1e-5)
                or torch.allclose(view, expected.flip(-1), atol=1e-5))


def test_simclr_grayscale_always_gives_equal_channels_before_normalisation() -> None:
    transform = SimCLRViews("cifar", jitter_p=0.0, grayscale_p=1.0, mean=(0.5, 0.5, 0.5),
                            std=(0.5, 0.5, 0.5))
    view = transform(_image())[0]
    assert torch.equal(view[0], view[1]) and torch.equal(view[1], view[2])
    assert view.min() >= -1.0 and view.max() <= 1.0


def test_presets_follow_the_simclr_paper() -> None:
    cifar, imagenet = SimCLRViews("cifar"), SimCLRViews("imagenet")
    cifar_jitter = next(s for s in _steps(cifar) if isinstance(s, v2.ColorJitter))
    assert cifar_jitter.brightness == pytest.approx((0.6, 1.4))  # 0.8 × s with s = 0.5
    assert cifar_jitter.hue == pytest.approx((-0.1, 0.1))  # 0.2 × s
    assert not any(isinstance(s, v2.GaussianBlur) for s in _steps(cifar))
    blur = next(s for s in _steps(imagenet) if isinstance(s, v2.GaussianBlur))
    assert list(blur.kernel_size) == [23, 23]  # 10% of 224, odd
    imagenet_jitter = next(s for s in _steps(imagenet) if isinstance(s, v2.ColorJitter))
    assert imagenet_jitter.brightness == pytest.approx((0.2, 1.8))  # s = 1.0
    assert imagenet(_image((300, 250)))[0].shape == (3, 224, 224)
    assert any(isinstance(s, v2.RandomSolarize) for s in _steps(SimCLRViews(solarize_p=0.2)))


def test_views_are_normalised_to_zero_mean_unit_std_on_average() -> None:
    # Uniform random pixels have mean 0.5 and std ~0.289 per channel; with mean/std set to those
    # values the views (no colour ops) must come out standardised.
    transform = SimCLRViews("cifar", jitter_p=0.0, grayscale_p=0.0, mean=(0.5, 0.5, 0.5),
                            std=(0.2887, 0.2887, 0.2887), crop_scale=(1.0, 1.0))
    views = torch.stack([transform(_image(seed=s))[0] for s in range(8)])
    assert views.mean().abs() < 0.02 and (views.std() - 1).abs() < 0.02


def test_eval_transform_is_deterministic_and_exact() -> None:
    image = _image(seed=2)
    cifar = EvalTransform("cifar")
    assert torch.equal(cifar(image), cifar(image))
    assert torch.allclose(cifar(image), _normalized(image, CIFAR_MEAN, CIFAR_STD), atol=1e-5)
    assert EvalTransform("imagenet")(_image((400, 300))).shape == (3, 224, 224)
    assert EvalTransform("cifar", crop_size=24, resize_size=28)(image).shape == (3, 24, 24)


def test_linear_eval_transform_is_one_random_view() -> None:
    torch.manual_seed(0)
    transform = LinearEvalTransform("cifar")
    outputs = [transform(_image(seed=3)) for _ in range(4)]
    assert all(len(views) == 1 and views[0].shape == (3, 32, 32) for views in outputs)
    assert any(not torch.equal(outputs[0][0], other[0]) for other in outputs[1:])
    assert LinearEvalTransform("imagenet")(_image((300, 260)))[0].shape == (3, 224, 224)


def test_multiview_base_runs_one_pipeline_per_view() -> None:
    small = v2.Compose([v2.ToImage(), v2.Resize(16), v2.ToDtype(torch.float32, scale=True)])
    large = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    transform = MultiViewTransform([large, small, small])
    views = transform(_image())
    assert transform.num_views == 3
    assert [tuple(v.shape) for v in views] == [(3, 32, 32), (3, 16, 16), (3, 16, 16)]
    with pytest.raises(ValueError, match="at least one view"):
        MultiViewTransform([])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "mnist"}, "mnist"),
        ({"num_views": 0}, "num_views"),
        ({"crop_scale": (0.5, 0.2)}, r"\(0.5, 0.2\)"),
        ({"jitter_p": 1.5}, "jitter_p.*1.5"),
        ({"grayscale_p": -0.1}, "grayscale_p"),
        ({"jitter_strength": -1.0}, "jitter_strength"),
        ({"mean": (0.5, 0.5)}, "mean and std"),
        ({"crop_size": 0}, "crop_size"),
    ],
)
def test_simclr_views_reject_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimCLRViews(**kwargs)


def test_eval_transform_rejects_resize_smaller_than_crop() -> None:
    with pytest.raises(ValueError, match="resize_size"):
        EvalTransform("imagenet", crop_size=224, resize_size=200)


def test_presets_are_the_documented_ones() -> None:
    assert PRESETS["cifar"].crop_size == 32 and PRESETS["cifar"].blur_p == 0.0
    assert PRESETS["imagenet"].crop_size == 224 and PRESETS["imagenet"].blur_p == 0.5
