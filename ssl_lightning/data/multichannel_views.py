"""Views of images with any number of channels, in the files' own units (data/arrays.py).

Colour jitter, grayscale and solarisation assume three colour channels of 8-bit range, so they
are not used here; the augmentations are the geometric ones of SimCLR (random resized crop,
flip) plus what holds for any band: a per-image brightness and contrast change applied to every
channel alike (multiplicative, so physical ratios between bands are kept) and Gaussian blur.
Normalisation uses per-channel statistics of the data (``python -m ssl_lightning channel-stats``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torchvision.transforms import v2

from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform


class ChannelNormalize:
    """``(x - mean) / std`` per channel, checking the image's channel count."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std) or not mean or not all(map(math.isfinite, [*mean, *std])) \
                or min(std) <= 0:
            raise ValueError(f"mean and std need one finite value per channel each (the same "
                             f"count) and std > 0; got mean={list(mean)}, std={list(std)}. "
                             "Compute them with python -m ssl_lightning channel-stats --images "
                             "DIR.")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: Tensor) -> Tensor:
        if image.shape[0] != self.mean.shape[0]:
            raise ValueError(f"An image has {image.shape[0]} channels but mean/std give "
                             f"{self.mean.shape[0]}: set mean and std for this data "
                             "(python -m ssl_lightning channel-stats --images DIR).")
        return (image - self.mean) / self.std

    def probe_input(self) -> Tensor:
        """A 256 px image of this channel count at the mean (for the data module's checks)."""
        return self.mean.expand(-1, 256, 256).clone()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(channels={self.mean.shape[0]})"


class RandomIntensity:
    """With probability ``p``, scale the image by ``b ~ U(1 - brightness, 1 + brightness)`` and
    its contrast around its mean by ``c ~ U(1 - contrast, 1 + contrast)``, the same factors for
    every channel."""

    def __init__(self, brightness: float = 0.4, contrast: float = 0.4, p: float = 0.8) -> None:
        for name, value in (("brightness", brightness), ("contrast", contrast)):
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}.")
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}.")
        self.brightness, self.contrast, self.p = brightness, contrast, p

    def __call__(self, image: Tensor) -> Tensor:
        draws = torch.rand(3)
        if draws[0] >= self.p:
            return image
        b = 1 + self.brightness * (2 * draws[1].item() - 1)
        c = 1 + self.contrast * (2 * draws[2].item() - 1)
        mean = image.mean(dim=(1, 2), keepdim=True)
        return ((image - mean) * c + mean) * b

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(brightness={self.brightness}, "
                f"contrast={self.contrast}, p={self.p})")


class MultiChannelViews(MultiViewTransform):
    """``num_views`` SimCLR-style views of a ``(C, H, W)`` float image of any channel count.

    Args:
        mean: Per-channel mean of the data (in the files' units).
        std: Per-channel standard deviation of the data.
        crop_size: Side of the random resized crop.
        num_views: Views per image.
        crop_scale: Area range of the crop.
        flip_p: Probability of a horizontal flip.
        brightness: Range of the brightness factor (:class:`RandomIntensity`).
        contrast: Range of the contrast factor.
        intensity_p: Probability of the intensity change.
        blur_p: Probability of a Gaussian blur (kernel ~10 % of the crop, sigma 0.1-2).
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        crop_size: int = 224,
        num_views: int = 2,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        flip_p: float = 0.5,
        brightness: float = 0.4,
        contrast: float = 0.4,
        intensity_p: float = 0.8,
        blur_p: float = 0.5,
    ) -> None:
        if num_views < 1 or crop_size < 1:
            raise ValueError(f"num_views and crop_size must be >= 1, got {num_views}, "
                             f"{crop_size}.")
        kernel = int(0.1 * crop_size) // 2 * 2 + 1  # odd, 10 % of the crop (as DeviceViews)
        pipeline = v2.Compose([
            v2.RandomResizedCrop(crop_size, scale=crop_scale, antialias=True),
            v2.RandomHorizontalFlip(flip_p),
            RandomIntensity(brightness, contrast, intensity_p),
            v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=blur_p),
            ChannelNormalize(mean, std),
        ])
        self.probe_input = pipeline.transforms[-1].probe_input
        super().__init__([pipeline] * num_views)


class MultiChannelEval(EvalTransform):
    """Evaluation view of a ``(C, H, W)`` float image: resize the shorter side, centre crop,
    normalise per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], crop_size: int = 224,
                 resize_size: int | None = None) -> None:  # noqa: D107 (no preset: not super's)
        resize = resize_size if resize_size is not None else crop_size
        if resize < crop_size:
            raise ValueError(f"resize_size ({resize}) must be >= crop_size ({crop_size}).")
        normalize = ChannelNormalize(mean, std)
        self.settings = {
            "preset": "multichannel", "image_reader": "array", "crop_size": crop_size,
            "resize_size": resize, "interpolation": "bilinear", "channels": len(mean),
            "mean": [float(v) for v in mean], "std": [float(v) for v in std],
            "normalization": "(x - mean) / std per channel, in the files' units"}
        self.transform = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop_size),
                                     normalize])
        self.probe_input = normalize.probe_input
