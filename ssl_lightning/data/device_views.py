"""SimCLR views made from a whole uint8 batch at once, on the batch's device (GPU or CPU).

The data loader only decodes images to fixed-size uint8 tensors (:class:`UInt8Image`); after the
batch is on the accelerator (or in the loader workers' collate step, on the CPU),
:class:`DeviceViews` makes every view with batched tensor ops, each sample drawing its own random
parameters (:meth:`DeviceViews.draw_params`): random resized crop (antialiased bilinear
resampling with the weights of torchvision's ``resized_crop(antialias=True)``, as two batched
matrix products), horizontal flip, colour jitter in a random order per sample, grayscale,
Gaussian blur, solarisation and normalisation. The recipe is the SimCLR augmentation (Chen et
al., "A Simple Framework for Contrastive Learning of Visual Representations", ICML 2020,
Appendix A) with the parameter ranges of ``torchvision.transforms``, drawn with the same
distributions as :class:`~ssl_lightning.data.SimCLRViews` (tests/data/test_views_distribution.py,
docs/batched_views.md).

With ``weak_views`` the batch also gets ReSSL's weak views (Zheng et al. 2021, §3.3: random
resized crop of scale (0.2, 1) and a flip, nothing photometric; the per-image
:func:`~ssl_lightning.data.transforms.weak_augmentation`), after the ``num_views`` views.

Enable it with ``SSLDataModule(device_transform=DeviceViews(...))``: the module's
``on_after_batch_transfer`` hook turns the uint8 training batch into views. It also runs on the
CPU, where one batched call is much cheaper than per-image transforms.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from ssl_lightning.data.seeding import counter_uniform, view_seed_tensor
from ssl_lightning.data.transforms import (
    MultiViewTransform,
    Triple,
    check_weak_views,
    get_preset,
)
from ssl_lightning.distributed import rank

_GRAY = (0.2989, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale


def _pil_to_uint8(image: Image.Image) -> Tensor:
    array = np.array(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array).permute(2, 0, 1)


class UInt8Image(MultiViewTransform):
    """Decode only: image -> ``[uint8 tensor (3, size, size)]`` for :class:`DeviceViews`.

    Args:
        size: Resize the shorter side to ``size`` and centre-crop a square (bilinear, PIL), so
            that images of different shapes batch together; ``None`` keeps the image as is (all
            images must then share one size, e.g. CIFAR's 32 px).
    """

    def __init__(self, size: int | None = None) -> None:
        if size is not None and size <= 0:
            raise ValueError(f"UInt8Image size must be > 0 or None, got {size}.")
        self.size = size
        super().__init__([self._decode])

    @classmethod
    def for_preset(cls, preset: str) -> UInt8Image:
        """Images of any size as squares of the preset's crop size when it resizes first
        (``"cifar"``: 32 px, CIFAR images unchanged), else of its evaluation size (``"imagenet"``:
        256 px)."""
        p = get_preset(preset)
        return cls(p.crop_size if p.resize_first else p.resize_size)

    def _decode(self, image: Image.Image) -> Tensor:
        if self.size is not None and image.size != (self.size, self.size):
            w, h = image.size
            side = min(w, h)  # the centre square, in whole pixels: its box lies inside the image
            left, top = (w - side) / 2, (h - side) / 2
            image = image.resize((self.size, self.size), Image.Resampling.BILINEAR,
                                 box=(left, top, left + side, top + side))
        return _pil_to_uint8(image)


def _gray(x: Tensor) -> Tensor:
    r, g, b = x.unbind(1)
    return (_GRAY[0] * r + _GRAY[1] * g + _GRAY[2] * b).unsqueeze(1)


def _shift_hue(x: Tensor, shift: Tensor) -> Tensor:
    """HSV hue rotation by ``shift`` (fraction of a turn) per sample, for x in [0, 1]."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    delta = maxc - minc
    sat = delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc))
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.where(delta > 0, hue / 6.0, torch.zeros_like(hue))
    hue = torch.remainder(hue + shift.view(-1, 1, 1), 1.0) * 6.0
    sector = hue.floor()
    frac = hue - sector
    sector = sector.long().remainder(6).unsqueeze(1)
    v = maxc
    p, q, t = v * (1 - sat), v * (1 - sat * frac), v * (1 - sat * (1 - frac))
    table = torch.stack([v, q, p, p, t, v, t, v, v, q, p, p, p, p, t, v, v, q], 1)
    table = table.view(x.shape[0], 3, 6, *x.shape[2:])
    return table.gather(2, sector.unsqueeze(1).expand(-1, 3, 1, -1, -1)).squeeze(2)


def _resample_weights(start: Tensor, length: Tensor, in_size: int, out_size: int) -> Tensor:
    """(n, out_size, in_size) antialiased bilinear weights of the crops ``[start, start +
    length)``: a triangle filter widened by the down-scaling factor, cut at the crop's edges and
    normalised (the rule of PIL and of torch's ``antialias=True`` resize)."""
    scale = (length / out_size).view(-1, 1, 1)
    support = scale.clamp(min=1.0)
    steps = torch.arange(out_size, device=start.device, dtype=start.dtype).view(1, -1, 1)
    centre = start.view(-1, 1, 1) + (steps + 0.5) * scale
    pixel = torch.arange(in_size, device=start.device, dtype=start.dtype).view(1, 1, -1) + 0.5
    weights = (1 - ((pixel - centre) / support).abs()).clamp_(min=0)
    inside = (pixel > start.view(-1, 1, 1)) & (pixel < (start + length).view(-1, 1, 1))
    weights = weights * inside
    return weights / weights.sum(2, keepdim=True)


def resized_crop(x: Tensor, boxes: Tensor, size: int) -> Tensor:
    """Crop every sample of ``x`` (n, c, h, w) to its box ``x0, y0, x1, y1`` (integers) and
    resize it to (size, size), as torchvision's ``resized_crop(..., antialias=True)``."""
    n, c, h, w = x.shape
    x0, y0, x1, y1 = boxes.to(x.dtype).unbind(1)
    rows = _resample_weights(y0, y1 - y0, h, size)
    columns = _resample_weights(x0, x1 - x0, w, size)
    y = torch.bmm(x.reshape(n, c * h, w), columns.transpose(1, 2))  # (n, c*h, size)
    y = y.view(n, c, h, size).transpose(1, 2).reshape(n, h, c * size)
    y = torch.bmm(rows, y)  # (n, size, c*size)
    return y.view(n, size, c, size).transpose(1, 2).contiguous()


def _gaussian_blur(x: Tensor, sigma: Tensor, kernel_size: int) -> Tensor:
    """Separable Gaussian blur with one sigma per sample (reflect padding, as torchvision)."""
    n, c, h, w = x.shape
    half = (kernel_size - 1) / 2
    t = torch.linspace(-half, half, kernel_size, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (t / sigma.to(x.dtype).view(-1, 1)) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (n*c, k)
    pad = kernel_size // 2
    y = F.pad(x.reshape(1, n * c, h, w), (pad, pad, pad, pad), mode="reflect")
    y = F.conv2d(y, kernel.view(n * c, 1, 1, kernel_size), groups=n * c)
    y = F.conv2d(y, kernel.view(n * c, 1, kernel_size, 1), groups=n * c)
    return y.view(n, c, h, w)


class ViewParams(NamedTuple):
    """The random parameters of one view of a batch, one row per sample.

    Attributes:
        boxes: (n, 4) integer crop boxes ``x0, y0, x1, y1`` (float).
        flip: (n,) horizontal flip.
        jitter: (n,) colour jitter applied.
        factors: (n, 3) brightness, contrast and saturation factors (1 without jitter).
        hue: (n,) hue shift in turns (0 without jitter).
        order: (n, 4) order of the jitter's 0 brightness, 1 contrast, 2 saturation, 3 hue.
        gray: (n,) grayscale.
        blur_sigma: (n,) Gaussian blur sigma (0: no blur).
        solarize: (n,) solarisation.
    """

    boxes: Tensor
    flip: Tensor
    jitter: Tensor
    factors: Tensor
    hue: Tensor
    order: Tensor
    gray: Tensor
    blur_sigma: Tensor
    solarize: Tensor


class DeviceViews:
    """Batched SimCLR views from uint8 images, each sample with its own random parameters.

    Arguments left as ``None`` take the preset's value (see ``ssl_lightning.data.PRESETS``).

    Args:
        preset: ``"cifar"`` (32 px, s=0.5, no blur) or ``"imagenet"`` (224 px, s=1.0, blur 0.5).
        num_views: Views returned per image.
        crop_size: Output side; preset default if None.
        crop_scale: Area range of the random resized crop, as a fraction of the image.
        crop_ratio: Aspect-ratio range of the crop (sampled log-uniformly).
        flip_p: Probability of a horizontal flip.
        jitter_strength: Colour strength ``s`` (brightness/contrast/saturation 0.8·s, hue 0.2·s).
        jitter_p: Probability of the colour jitter (its 4 operations in a random order).
        grayscale_p: Probability of grayscale.
        blur_p: Probability of Gaussian blur (sigma in [0.1, 2], kernel 10% of the crop, odd).
        solarize_p: Probability of solarisation (values >= 128/255 inverted).
        mean: Normalisation mean; preset default if None.
        std: Normalisation standard deviation; preset default if None.
        weak_views: Weak views appended after the ``num_views`` views (ReSSL's teacher view).
        weak_crop_scale: Area range of the weak views' crop (ReSSL: (0.2, 1)).
    """

    def __init__(
        self,
        preset: str = "cifar",
        num_views: int = 2,
        crop_size: int | None = None,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        jitter_strength: float | None = None,
        jitter_p: float = 0.8,
        grayscale_p: float = 0.2,
        blur_p: float | None = None,
        solarize_p: float = 0.0,
        mean: Triple | None = None,
        std: Triple | None = None,
        weak_views: int = 0,
        weak_crop_scale: tuple[float, float] = (0.2, 1.0),
    ) -> None:
        p = get_preset(preset)
        self.crop_size = crop_size if crop_size is not None else p.crop_size
        self.jitter_strength = jitter_strength if jitter_strength is not None else p.jitter_strength
        self.blur_p = blur_p if blur_p is not None else p.blur_p
        if num_views < 1 or self.crop_size < 1:
            raise ValueError(f"num_views and crop_size must be >= 1, got {num_views}, "
                             f"{self.crop_size}.")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {crop_scale}.")
        if not 0 < crop_ratio[0] <= crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < min <= max, got {crop_ratio}.")
        if self.jitter_strength < 0:
            raise ValueError(f"jitter_strength must be >= 0, got {self.jitter_strength}.")
        for name, prob in [("flip_p", flip_p), ("jitter_p", jitter_p),
                           ("grayscale_p", grayscale_p), ("blur_p", self.blur_p),
                           ("solarize_p", solarize_p)]:
            if not 0 <= prob <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {prob}.")
        self.num_views = num_views
        self.crop_scale, self.crop_ratio = crop_scale, crop_ratio
        self.flip_p, self.jitter_p, self.grayscale_p = flip_p, jitter_p, grayscale_p
        self.solarize_p = solarize_p
        self.mean = mean if mean is not None else p.mean
        self.std = std if std is not None else p.std
        self.blur_kernel = int(0.1 * self.crop_size) // 2 * 2 + 1
        self._generator: torch.Generator | None = None
        self._keys: Tensor | None = None  # per-sample streams of the view being made
        self._counter = 0
        self.weak_views = check_weak_views(weak_views)
        self._weak = None if weak_views == 0 else DeviceViews(
            preset, weak_views, self.crop_size, weak_crop_scale, crop_ratio, flip_p,
            jitter_strength=0.0, jitter_p=0.0, grayscale_p=0.0, blur_p=0.0, mean=self.mean,
            std=self.std)

    def _uniform(self, shape: tuple[int, ...], low: float = 0.0, high: float = 1.0, *,
                 device: Any, rows: Tensor | None = None) -> Tensor:
        """U(low, high) samples, one row per sample (``rows``: the samples' positions).

        With per-sample seeds (the data modules pass them) row ``i`` is a pure function of
        sample ``i``'s seed, the view and the draw's position in the recipe. Without, the draws
        come from this transform's generator, seeded from the global CPU RNG (so
        ``seed_everything`` makes runs reproducible) plus the process rank, so DDP ranks draw
        different parameters for their different images."""
        device = torch.device(device)
        if self._keys is not None:
            keys = self._keys if rows is None else self._keys[rows]
            columns = math.prod(shape[1:])
            self._counter += 1
            u = counter_uniform(keys, self._counter, columns).view(shape)
            return u * (high - low) + low
        if self._generator is None or self._generator.device != device:
            seed = int(torch.randint(0, 2**62, (1,)).item()) + 1_000_003 * rank()
            self._generator = torch.Generator(device).manual_seed(seed)
        return torch.empty(shape, device=device).uniform_(low, high, generator=self._generator)

    def __call__(self, images: Tensor, seeds: Tensor | None = None) -> list[Tensor]:
        """``images``: uint8 (B, 3, H, W) -> ``num_views`` (+ ``weak_views``) float (B, 3, crop,
        crop) tensors.

        ``seeds``: optional int64 (B,) per-sample seeds (the data modules' loaders add them);
        view ``v`` of sample ``i`` is then a pure function of ``(seeds[i], v)``.
        """
        x = self.prepare(images)
        if seeds is not None and (seeds.dtype != torch.int64 or seeds.shape != images.shape[:1]):
            raise ValueError(f"seeds must be int64 of shape ({images.shape[0]},), got "
                             f"{seeds.dtype} {tuple(seeds.shape)}.")
        views = []
        for v in range(self.num_views + self.weak_views):
            maker = self if v < self.num_views or self._weak is None else self._weak
            maker._keys = None if seeds is None else view_seed_tensor(seeds.to(x.device), v)
            maker._counter = 0
            try:
                views.append(maker.view(x))
            finally:
                maker._keys = None
        return views

    def prepare(self, images: Tensor) -> Tensor:
        """The decoded batch, checked, as floats in [0, 1]: uint8 (B, 3, H, W) / 255."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"DeviceViews expects uint8 (B, 3, H, W) images, got "
                             f"{images.dtype} {tuple(images.shape)}; with a device_transform "
                             "the data module's train_transform must only decode: UInt8Image.")
        return images.float().div_(255)

    def crop_boxes(self, n: int, height: int, width: int, device: Any) -> Tensor:
        """(n, 4) boxes ``x0, y0, x1, y1`` drawn as torchvision's RandomResizedCrop (10 tries,
        then the largest centred box within the ratio range)."""
        tries = 10
        area = height * width * self._uniform((n, tries), *self.crop_scale, device=device)
        log_ratio = self._uniform((n, tries), math.log(self.crop_ratio[0]),
                                  math.log(self.crop_ratio[1]), device=device)
        w = torch.sqrt(area * log_ratio.exp()).round()
        h = torch.sqrt(area / log_ratio.exp()).round()
        ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = ok.float().argmax(1, keepdim=True)
        w, h, found = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0], ok.any(1)
        ratio = width / height
        fb_w = float(width) if ratio <= self.crop_ratio[1] else round(height * self.crop_ratio[1])
        fb_h = float(height) if ratio >= self.crop_ratio[0] else round(width / self.crop_ratio[0])
        w = torch.where(found, w, torch.full_like(w, fb_w))
        h = torch.where(found, h, torch.full_like(h, fb_h))
        u = self._uniform((n, 2), device=device)
        # randint(0, width - w + 1); the clamp guards float32 rounding of u * n up to n.
        x0 = torch.where(found, torch.minimum((u[:, 0] * (width - w + 1)).floor(), width - w),
                         ((width - w) / 2).floor())
        y0 = torch.where(found, torch.minimum((u[:, 1] * (height - h + 1)).floor(), height - h),
                         ((height - h) / 2).floor())
        return torch.stack([x0, y0, x0 + w, y0 + h], 1)

    def view(self, x: Tensor) -> Tensor:
        """One view of a float batch in [0, 1]."""
        return self.apply(x, self.draw_params(x.shape[0], x.shape[2], x.shape[3], x.device))

    def draw_params(self, n: int, height: int, width: int, device: Any) -> ViewParams:
        """The random parameters of one view of ``n`` images of ``height`` x ``width``."""
        boxes = self.crop_boxes(n, height, width, device)
        flip = self._uniform((n,), device=device) < self.flip_p
        factors, hue = torch.ones(n, 3, device=device), torch.zeros(n, device=device)
        order = torch.arange(4, device=device).expand(n, 4)
        jitter = torch.zeros(n, dtype=torch.bool, device=device)
        s = self.jitter_strength
        if s > 0 and self.jitter_p > 0:
            jitter = self._uniform((n, 1), device=device)[:, 0] < self.jitter_p
            drawn = self._uniform((n, 3), max(0.0, 1 - 0.8 * s), 1 + 0.8 * s, device=device)
            factors = torch.where(jitter.unsqueeze(1), drawn, factors)
            hue = self._uniform((n,), -0.2 * s, 0.2 * s, device=device) * jitter
            order = self._uniform((n, 4), device=device).argsort(1)
        gray = self._uniform((n,), device=device) < self.grayscale_p
        sigma = torch.zeros(n, device=device)
        if self.blur_p > 0:
            blur = (self._uniform((n,), device=device) < self.blur_p).nonzero()[:, 0]
            sigma[blur] = self._uniform((len(blur),), 0.1, 2.0, device=device, rows=blur)
        solarize = torch.zeros(n, dtype=torch.bool, device=device)
        if self.solarize_p > 0:
            solarize = self._uniform((n,), device=device) < self.solarize_p
        return ViewParams(boxes, flip, jitter, factors, hue, order, gray, sigma, solarize)

    def apply(self, x: Tensor, params: ViewParams) -> Tensor:
        """Make the view ``params`` of the float batch ``x`` in [0, 1]; normalised output."""
        x = resized_crop(x, params.boxes, self.crop_size)
        x = torch.where(params.flip.view(-1, 1, 1, 1), x.flip(-1), x)
        if params.jitter.any():
            x = color_jitter(x, params.factors, params.hue, params.order)
        x = torch.where(params.gray.view(-1, 1, 1, 1), _gray(x).expand_as(x), x)
        blur = params.blur_sigma.nonzero()[:, 0]
        if len(blur):
            x[blur] = _gaussian_blur(x[blur], params.blur_sigma[blur], self.blur_kernel)
        solarize = params.solarize.view(-1, 1, 1, 1)
        x = torch.where(solarize & (x >= 128 / 255), 1.0 - x, x)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std


def color_jitter(x: Tensor, factors: Tensor, hue: Tensor, order: Tensor) -> Tensor:
    """torchvision's ColorJitter with per-sample parameters and order, batched.

    Args:
        x: (B, 3, H, W) in [0, 1].
        factors: (B, 3) brightness, contrast and saturation factors (1 = unchanged).
        hue: (B,) hue shift in turns (0 = unchanged).
        order: (B, 4) permutation of 0 brightness, 1 contrast, 2 saturation, 3 hue per sample.
    """
    for position in range(4):
        op = order[:, position].view(-1, 1, 1, 1)
        gray = _gray(x)
        target = torch.where(op == 0, torch.zeros_like(gray),
                             torch.where(op == 1, gray.mean((1, 2, 3), keepdim=True), gray))
        f = factors.gather(1, op.view(-1, 1).clamp(max=2)).view(-1, 1, 1, 1)
        x = torch.where(op == 3, x, (f * x + (1 - f) * target).clamp_(0, 1))
        rows = ((op.view(-1) == 3) & (hue != 0)).nonzero()[:, 0]
        x[rows] = _shift_hue(x[rows], hue[rows])
    return x
