"""Batched views from uint8 batches (the accelerator path), checked on CPU: shapes, dtype, value
range, each sample's independent random parameters, each operation against torchvision's
per-image functional, and the data-module hook."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from ssl_lightning.data import CIFAR10DataModule
from ssl_lightning.data.device_views import (
    DeviceViews,
    UInt8Image,
    _gaussian_blur,
    _shift_hue,
    color_jitter,
    resized_crop,
)

PLAIN = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}  # no normalisation: values in [0, 1]


def _images(n: int, h: int = 20, w: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8)


def test_shapes_dtype_and_range():
    torch.manual_seed(0)
    views = DeviceViews("cifar", num_views=3, crop_size=16, blur_p=0.5, solarize_p=0.5,
                        **PLAIN)(_images(10))
    assert len(views) == 3
    for v in views:
        assert v.shape == (10, 3, 16, 16) and v.dtype == torch.float32
        assert v.min() >= 0 and v.max() <= 1
    normalized = DeviceViews("cifar")(_images(10, 32, 32))[0]
    mean, std = torch.tensor((0.4914, 0.4822, 0.4465)), torch.tensor((0.2470, 0.2435, 0.2616))
    low, high = (-mean / std).view(1, 3, 1, 1), ((1 - mean) / std).view(1, 3, 1, 1)
    assert normalized.shape == (10, 3, 32, 32)
    assert (normalized >= low - 1e-5).all() and (normalized <= high + 1e-5).all()
    assert normalized.std() > 0.3  # really spread over the normalised range


def test_rejects_float_input_and_bad_hyperparameters():
    with pytest.raises(ValueError, match="uint8"):
        DeviceViews()(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match="1.5"):
        DeviceViews(grayscale_p=1.5)
    with pytest.raises(ValueError, match="crop_scale"):
        DeviceViews(crop_scale=(0.5, 0.2))


def test_each_sample_draws_its_own_parameters():
    """A batch of one image repeated: every sample's view differs, the crop boxes of
    neighbouring samples are uncorrelated and the flip/jitter/gray rates match p."""
    torch.manual_seed(0)
    n = 4000
    transform = DeviceViews("cifar", **PLAIN)
    boxes = transform.crop_boxes(n, 20, 24, "cpu")
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / (20 * 24)
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 24).all() and (boxes[:, 3] <= 20).all()
    assert area.min() >= 0.05 and area.max() <= 1.0 and 0.4 < area.mean() < 0.65
    corr = torch.corrcoef(torch.stack([area[:-1], area[1:]]))[0, 1]
    assert abs(corr) < 0.1
    one = _images(1).expand(64, -1, -1, -1).contiguous()
    view = transform(one)[0]
    flat = view.flatten(1)
    distance = torch.cdist(flat, flat) + torch.eye(64) * 1e9
    assert distance.min() > 1e-3  # no two samples got the same view

    # Only a flip, on a left-right asymmetric image: about half the samples flipped.
    flip_only = DeviceViews("cifar", crop_size=8, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0),
                            jitter_p=0.0, grayscale_p=0.0, **PLAIN)
    ramp = torch.arange(8, dtype=torch.uint8).mul(30).expand(n, 3, 8, 8).contiguous()
    flipped = flip_only(ramp)[0][:, 0, 0, 0] > 0.5
    assert 0.45 < flipped.float().mean() < 0.55
    # Only jitter / grayscale: the fractions of changed samples are jitter_p and grayscale_p.
    for p_jitter, p_gray in [(0.8, 0.0), (0.0, 0.2)]:
        only = DeviceViews("cifar", crop_size=8, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0),
                           flip_p=0.0, jitter_p=p_jitter, grayscale_p=p_gray, **PLAIN)
        color = _images(1, 8, 8).expand(n, -1, -1, -1).contiguous()
        out = only(color)[0]
        changed = (out - color.float() / 255).flatten(1).abs().amax(1) > 1e-4
        assert abs(changed.float().mean() - max(p_jitter, p_gray)) < 0.03


def test_reproducible_under_a_seed_and_different_on_each_rank(monkeypatch):
    images = _images(8)

    def views_on_rank(rank: int) -> torch.Tensor:
        monkeypatch.setattr("ssl_lightning.data.device_views.rank", lambda: rank)
        torch.manual_seed(0)
        return DeviceViews("cifar", crop_size=16)(images)[0]

    assert torch.equal(views_on_rank(0), views_on_rank(0))
    assert not torch.allclose(views_on_rank(0), views_on_rank(1))


def test_crop_matches_torchvision_antialiased_resized_crop():
    """Up- and down-scaled crops (also non-square ones) equal torchvision's resized_crop with
    antialias=True, the resampling of SimCLRViews' RandomResizedCrop, edges included."""
    x = torch.rand(4, 3, 40, 48)
    boxes = [(3, 5, 13, 20), (10, 2, 30, 30), (0, 0, 48, 40), (1, 0, 47, 39)]
    for size in (16, 32):
        ours = resized_crop(x, torch.tensor(boxes, dtype=torch.float32), size)
        for i, (x0, y0, x1, y1) in enumerate(boxes):
            ref = TF.resized_crop(x[i], y0, x0, y1 - y0, x1 - x0, [size, size], antialias=True)
            torch.testing.assert_close(ours[i], ref, atol=1e-5, rtol=0)


def test_color_operations_match_torchvision_per_sample():
    torch.manual_seed(0)
    x = torch.rand(5, 3, 9, 11)
    shifts = torch.tensor([0.1, -0.3, 0.45, 0.0, -0.05])
    expected = torch.stack([TF.adjust_hue(xi, s.item()) for xi, s in zip(x, shifts, strict=True)])
    torch.testing.assert_close(_shift_hue(x, shifts), expected, atol=1e-5, rtol=0)
    sigma = torch.tensor([0.3, 0.7, 1.0, 1.5, 2.0])
    expected = torch.stack([TF.gaussian_blur(xi, [5, 5], [s.item()] * 2)
                            for xi, s in zip(x, sigma, strict=True)])
    torch.testing.assert_close(_gaussian_blur(x, sigma, 5), expected, atol=1e-5, rtol=0)

    factors = torch.tensor([[1.3, 0.7, 1.2], [0.6, 1.4, 0.5], [1.0, 1.0, 1.0],
                            [0.9, 1.1, 1.6], [1.5, 0.5, 0.8]])
    order = torch.stack([torch.randperm(4) for _ in range(5)])
    ops = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
    expected = []
    for xi, f, h, o in zip(x, factors, shifts, order, strict=True):
        for op in o.tolist():
            xi = ops[op](xi, h.item() if op == 3 else f[op].item())
        expected.append(xi)
    out = color_jitter(x.clone(), factors, shifts, order)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=0)


def test_uint8_image_decoding():
    image = Image.new("RGB", (50, 40), (10, 200, 30))
    (full,) = UInt8Image()(image)
    (square,) = UInt8Image(24)(image)
    assert full.shape == (3, 40, 50) and full.dtype == torch.uint8
    assert square.shape == (3, 24, 24) and square[:, 5, 5].tolist() == [10, 200, 30]
    assert UInt8Image.for_preset("imagenet").size == 256
    assert UInt8Image.for_preset("cifar").size == 32


def test_data_module_hook_makes_views_only_while_training():
    dm = CIFAR10DataModule(batch_size=4, num_workers=0, device_transform=DeviceViews("cifar"))
    assert isinstance(dm.train_transform, UInt8Image)
    batch = ([_images(4, 32, 32)], torch.arange(4))
    dm.trainer = SimpleNamespace(training=False)  # type: ignore[assignment]
    assert dm.on_after_batch_transfer(batch, 0) is batch
    dm.trainer = SimpleNamespace(training=True)  # type: ignore[assignment]
    views, targets = dm.on_after_batch_transfer(batch, 0)
    assert len(views) == 2 and views[0].shape == (4, 3, 32, 32) and views[0].dtype == torch.float32
    assert torch.equal(targets, torch.arange(4))


@pytest.mark.parametrize(("size", "wh"), [(32, (93, 140)), (256, (140, 91)), (32, (49, 49))])
def test_uint8_image_takes_sides_whose_scale_rounds(size: int, wh: tuple[int, int]) -> None:
    # size / (size / m) != m in floating point for these shorter sides m: the centre crop's
    # box must still lie inside the image (PIL refuses a negative offset)
    image = Image.new("RGB", wh, (10, 200, 30))
    (square,) = UInt8Image(size)(image)
    assert square.shape == (3, size, size) and square[:, 0, 0].tolist() == [10, 200, 30]
