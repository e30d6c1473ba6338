"""Batched views of images with any number of channels, in the files' own units.

The batched counterpart of :class:`~ssl_lightning.data.MultiChannelViews` (same recipe: random
resized crop, flip, a brightness and contrast change applied to every band alike, Gaussian blur,
per-channel normalisation; no colour jitter, grayscale or solarisation, which assume 8-bit RGB).
The loader only decodes every file to a fixed-size float tensor (:class:`ArrayImage`);
:class:`MultiChannelDeviceViews` then makes every view of the batch at once with the crop, flip
and blur kernels of :class:`~ssl_lightning.data.DeviceViews`, each sample drawing its own
parameters from its seed, in the loader workers (CPU) or on the accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.data.device_views import DeviceViews, _gaussian_blur, resized_crop
from ssl_lightning.data.multichannel_views import ChannelNormalize, RandomIntensity
from ssl_lightning.data.transforms import MultiViewTransform


class ArrayImage(MultiViewTransform):
    """Decode only: a float ``(C, H, W)`` image -> ``[float (C, size, size)]`` for
    :class:`MultiChannelDeviceViews`, in the file's units.

    Args:
        size: Resize the centre square of the image to ``size`` (antialiased bilinear), so that
            images of different shapes batch together; ``None`` keeps the image as it is (every
            image must then have one size, e.g. fixed-size tiles).
    """

    def __init__(self, size: int | None = None) -> None:
        if size is not None and size <= 0:
            raise ValueError(f"ArrayImage size must be > 0 or None, got {size}.")
        self.size = size
        super().__init__([self._decode])

    def _decode(self, image: Tensor) -> Tensor:
        if self.size is None or tuple(image.shape[-2:]) == (self.size, self.size):
            return image
        h, w = image.shape[-2:]
        side = min(h, w)
        top, left = (h - side) // 2, (w - side) // 2
        square = image[None, :, top:top + side, left:left + side]
        return F.interpolate(square, size=(self.size, self.size), mode="bilinear",
                             antialias=True, align_corners=False)[0]


class BandViewParams(NamedTuple):
    """The random parameters of one multi-channel view of a batch, one row per sample.

    Attributes:
        boxes: (n, 4) integer crop boxes ``x0, y0, x1, y1`` (float).
        flip: (n,) horizontal flip.
        intensity: (n,) brightness and contrast change applied.
        brightness: (n,) brightness factor (1 without the change).
        contrast: (n,) contrast factor around the view's per-channel mean (1 without).
        blur_sigma: (n,) Gaussian blur sigma (0: no blur).
    """

    boxes: Tensor
    flip: Tensor
    intensity: Tensor
    brightness: Tensor
    contrast: Tensor
    blur_sigma: Tensor


class MultiChannelDeviceViews(DeviceViews):
    """Batched views of float ``(B, C, H, W)`` images of any channel count (see the module).

    Args:
        mean: Per-channel mean of the data, in the files' units
            (``python -m ssl_lightning channel-stats``).
        std: Per-channel standard deviation of the data.
        crop_size: Side of the random resized crop.
        num_views: Views per image.
        crop_scale: Area range of the crop, as a fraction of the image.
        crop_ratio: Aspect-ratio range of the crop (sampled log-uniformly).
        flip_p: Probability of a horizontal flip.
        brightness: Range of the brightness factor, ``U(1 - brightness, 1 + brightness)``.
        contrast: Range of the contrast factor.
        intensity_p: Probability of the brightness and contrast change.
        blur_p: Probability of a Gaussian blur (sigma in [0.1, 2], kernel 10 % of the crop).
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        crop_size: int = 224,
        num_views: int = 2,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        brightness: float = 0.4,
        contrast: float = 0.4,
        intensity_p: float = 0.8,
        blur_p: float = 0.5,
    ) -> None:
        self.normalize = ChannelNormalize(mean, std)
        self.intensity = RandomIntensity(brightness, contrast, intensity_p)
        super().__init__(num_views=num_views, crop_size=crop_size, crop_scale=crop_scale,
                         crop_ratio=crop_ratio, flip_p=flip_p, jitter_strength=0.0,
                         jitter_p=0.0, grayscale_p=0.0, blur_p=blur_p, solarize_p=0.0)
        self.mean, self.std = tuple(mean), tuple(std)  # type: ignore[assignment]

    @property
    def channels(self) -> int:
        """The channel count the statistics are given for."""
        return len(self.mean)

    def prepare(self, images: Tensor) -> Tensor:
        """The decoded float batch, checked: (B, C, H, W) with this transform's C."""
        if not images.is_floating_point() or images.dim() != 4 or (
                images.shape[1] != self.channels):
            raise ValueError(
                f"MultiChannelDeviceViews expects float (B, {self.channels}, H, W) images (one "
                f"channel per mean/std value), got {images.dtype} {tuple(images.shape)}; its "
                "train_transform must only decode: ArrayImage, with image_reader: array.")
        return images

    def draw_params(self, n: int, height: int, width: int, device: Any) -> BandViewParams:
        """The random parameters of one view of ``n`` images of ``height`` x ``width``."""
        boxes = self.crop_boxes(n, height, width, device)
        flip = self._uniform((n,), device=device) < self.flip_p
        draws = self._uniform((n, 3), device=device)
        intensity = draws[:, 0] < self.intensity.p
        ones = torch.ones(n, device=device)
        brightness = torch.where(
            intensity, 1 + self.intensity.brightness * (2 * draws[:, 1] - 1), ones)
        contrast = torch.where(intensity, 1 + self.intensity.contrast * (2 * draws[:, 2] - 1), ones)
        sigma = torch.zeros(n, device=device)
        if self.blur_p > 0:
            blur = (self._uniform((n,), device=device) < self.blur_p).nonzero()[:, 0]
            sigma[blur] = self._uniform((len(blur),), 0.1, 2.0, device=device, rows=blur)
        return BandViewParams(boxes, flip, intensity, brightness, contrast, sigma)

    def apply(self, x: Tensor, params: BandViewParams) -> Tensor:  # type: ignore[override]
        """Make the view ``params`` of the float batch ``x``; normalised output."""
        x = resized_crop(x, params.boxes, self.crop_size)
        x = torch.where(params.flip.view(-1, 1, 1, 1), x.flip(-1), x)
        mean = x.mean((2, 3), keepdim=True)
        b, c = params.brightness.view(-1, 1, 1, 1), params.contrast.view(-1, 1, 1, 1)
        x = torch.where(params.intensity.view(-1, 1, 1, 1), ((x - mean) * c + mean) * b, x)
        blur = params.blur_sigma.nonzero()[:, 0]
        if len(blur):
            x[blur] = _gaussian_blur(x[blur], params.blur_sigma[blur], self.blur_kernel)
        mean_c = self.normalize.mean.to(x.device).view(1, -1, 1, 1)
        std_c = self.normalize.std.to(x.device).view(1, -1, 1, 1)
        return (x - mean_c) / std_c

    def probe_input(self) -> Tensor:
        """A 256 px image of this channel count at the mean (for the data module's checks)."""
        return self.normalize.probe_input()
