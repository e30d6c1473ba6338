"""View transforms built on ``torchvision.transforms.v2``.

- :class:`MultiViewTransform`: the base class every training transform derives from. It maps one
  image to a *list* of view tensors by running one pipeline per view; a subclass only builds that
  list of pipelines (identical pipelines for SimCLR, asymmetric ones for BYOL, 2 global + N local
  crops for multi-crop). Data modules put the list into the batch as ``views``.
- :class:`SimCLRViews`: the SimCLR augmentation (Chen et al., "A Simple Framework for Contrastive
  Learning of Visual Representations", ICML 2020, Appendix A): random resized crop, horizontal
  flip, colour jitter (p=0.8, strength s), grayscale (p=0.2), Gaussian blur (ImageNet only) and
  normalisation, with ``"cifar"`` (32 px, s=0.5, no blur; Appendix B.9; images of any size are
  first resized to 32 px squares) and ``"imagenet"`` (224 px, s=1.0, blur p=0.5; crops of the
  image as it is) presets. :func:`simclr_augmentation` builds one such pipeline and is
  meant to be reused by other view recipes.
- :func:`weak_augmentation`: the weak view of ReSSL (Zheng et al., "ReSSL: Relational
  Self-Supervised Learning with Weak Augmentation", NeurIPS 2021, §3.3): a random resized crop
  of scale (0.2, 1) and a horizontal flip, nothing photometric. The view recipes append
  ``weak_views`` of them after their other views, for a method whose teacher sees a weak view.
- :class:`EvalTransform`: single deterministic view for kNN / probe evaluation.
- :class:`LinearEvalTransform`: the supervised training augmentation for linear evaluation
  (random crop + flip), as a one-view :class:`MultiViewTransform`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms import v2

from ssl_lightning.data.seeding import active_sample_seed, view_seed

PresetName = Literal["cifar", "imagenet"]
Triple = tuple[float, float, float]


@dataclass(frozen=True)
class Preset:
    """Per-dataset defaults of the view transforms.

    Attributes:
        crop_size: Side of the (training and evaluation) crops.
        resize_size: Shorter side the evaluation transform resizes to before the centre crop.
        mean: Per-channel normalisation mean.
        std: Per-channel normalisation standard deviation.
        jitter_strength: SimCLR colour-distortion strength ``s``.
        blur_p: Probability of the Gaussian blur.
        resize_first: Resize every image to a ``crop_size`` square (shorter side, then a centre
            crop) before the training views, so that images of any size become images of the
            preset's size (``"cifar"``: 32 px, a no-op on CIFAR images); otherwise the views crop
            the image as it is (a random resized crop takes any size).
    """

    crop_size: int
    resize_size: int
    mean: Triple
    std: Triple
    jitter_strength: float
    blur_p: float
    resize_first: bool = False


PRESETS: dict[str, Preset] = {
    # CIFAR-10 channel statistics; SimCLR B.9: colour strength 0.5, no blur for CIFAR-10.
    "cifar": Preset(32, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 0.5, 0.0,
                    resize_first=True),
    # ImageNet statistics; SimCLR Appendix A: s=1.0, blur with p=0.5; eval resize 256 -> crop 224.
    "imagenet": Preset(224, 256, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 1.0, 0.5),
}


def get_preset(name: str) -> Preset:
    """Return the preset called ``name``, with a clear error for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"Unknown transform preset {name!r}; choose one of {sorted(PRESETS)}.")
    return PRESETS[name]


def square_resize(size: int | None) -> list[Callable]:
    """``[Resize(size), CenterCrop(size)]`` (shorter side to ``size``, then the centre square:
    images of any size in, ``size`` squares out); ``[]`` for None."""
    if size is None:
        return []
    _check_positive("resize", size)
    return [v2.Resize(size, antialias=True), v2.CenterCrop(size)]


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value}.")


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")


def _to_normalized_tensor(mean: Sequence[float], std: Sequence[float]) -> list[Callable]:
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"mean and std need 3 values each and std > 0; got {mean}, {std}.")
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]


class ToNormalizedTensor:
    """PIL image or uint8 (C, H, W) tensor -> ``(x / 255 - mean) / std`` float tensor in one step
    (per image ~1.4x cheaper than ToImage + ToDtype + Normalize; benchmarks/views_speed.py)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        _to_normalized_tensor(mean, std)  # validates
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, image: Any) -> Tensor:
        if not isinstance(image, Tensor):
            image = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        return image.float().div_(255).sub_(self.mean).div_(self.std)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean.flatten().tolist()}, " \
               f"std={self.std.flatten().tolist()})"


def simclr_augmentation(
    crop_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    crop_scale: tuple[float, float] = (0.08, 1.0),
    jitter_strength: float = 1.0,
    jitter_p: float = 0.8,
    grayscale_p: float = 0.2,
    blur_p: float = 0.0,
    solarize_p: float = 0.0,
    flip_p: float = 0.5,
    jitter: tuple[float, float, float, float] | None = None,
    interpolation: Literal["bilinear", "bicubic"] = "bilinear",
    resize: int | None = None,
) -> v2.Compose:
    """One SimCLR-style augmentation pipeline: PIL image or tensor -> normalised float tensor.

    Crop, flip, colour jitter and grayscale run on the input (on a PIL image these are the fastest
    kernels, measured), blur/solarize on a uint8 tensor, then one conversion to a normalised
    float tensor (:class:`ToNormalizedTensor`).

    Args:
        crop_size: Output side of the random resized crop.
        mean: Normalisation mean per channel.
        std: Normalisation standard deviation per channel.
        crop_scale: Range of the crop area as a fraction of the image area.
        jitter_strength: Colour-distortion strength ``s``: brightness, contrast and saturation
            0.8·s, hue 0.2·s (SimCLR Appendix A).
        jitter_p: Probability of applying the colour jitter.
        grayscale_p: Probability of converting to grayscale.
        blur_p: Probability of a Gaussian blur with sigma in [0.1, 2] and a kernel 10% of the
            crop size (odd).
        solarize_p: Probability of solarising (threshold 128 on uint8, as in BYOL).
        flip_p: Probability of a horizontal flip.
        jitter: Explicit (brightness, contrast, saturation, hue) of the colour jitter, replacing
            the ``jitter_strength`` rule (BYOL: (0.4, 0.4, 0.2, 0.1)).
        interpolation: Resampling of the random resized crop (DINO: ``"bicubic"``).
        resize: First resize every image to a square of this side (:func:`square_resize`);
            None crops the image as it is.

    Returns:
        The composed pipeline.
    """
    _check_positive("crop_size", crop_size)
    if not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {crop_scale}.")
    if jitter_strength < 0:
        raise ValueError(f"jitter_strength must be >= 0, got {jitter_strength}.")
    for name, p in [("jitter_p", jitter_p), ("grayscale_p", grayscale_p), ("blur_p", blur_p),
                    ("solarize_p", solarize_p), ("flip_p", flip_p)]:
        _check_probability(name, p)
    s = jitter_strength
    brightness, contrast, saturation, hue = jitter or (0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)
    if min(brightness, contrast, saturation, hue) < 0 or hue > 0.5:
        raise ValueError(f"jitter needs values >= 0 and hue <= 0.5, got {jitter}.")
    steps: list[Callable] = [
        *square_resize(resize),
        v2.RandomResizedCrop(crop_size, scale=crop_scale, antialias=True,
                             interpolation=v2.InterpolationMode(interpolation)),
        v2.RandomHorizontalFlip(p=flip_p),
        v2.RandomApply([v2.ColorJitter(brightness, contrast, saturation, hue)], p=jitter_p),
        v2.RandomGrayscale(p=grayscale_p),
    ]
    if blur_p > 0 or solarize_p > 0:
        steps.append(v2.ToImage())
    if blur_p > 0:
        kernel = int(0.1 * crop_size) // 2 * 2 + 1
        steps.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=blur_p))
    if solarize_p > 0:
        steps.append(v2.RandomSolarize(threshold=128, p=solarize_p))
    return v2.Compose([*steps, ToNormalizedTensor(mean, std)])


def weak_augmentation(crop_size: int, mean: Sequence[float], std: Sequence[float],
                      crop_scale: tuple[float, float] = (0.2, 1.0),
                      resize: int | None = None) -> v2.Compose:
    """ReSSL's weak view (Zheng et al. 2021, §3.3): :func:`simclr_augmentation` with only the
    random resized crop (scale (0.2, 1) in the paper) and the horizontal flip left on; no colour
    jitter, grayscale, blur or solarisation."""
    return simclr_augmentation(crop_size, mean, std, crop_scale, jitter_p=0.0, grayscale_p=0.0,
                               resize=resize)


def check_weak_views(weak_views: int) -> int:
    """``weak_views`` itself, or a ``ValueError`` when it is negative."""
    if weak_views < 0:
        raise ValueError(f"weak_views must be >= 0 (the number of weak views appended after the "
                         f"other views), got {weak_views}.")
    return weak_views


class MultiViewTransform:
    """Base class of training transforms: one image in, a list of view tensors out.

    Holds one pipeline per view and applies each to the same input image; the pipelines may be the
    same object (fresh random parameters on every call) or differ per view. Subclasses build the
    list and pass it to ``super().__init__``; the data modules collate the lists into
    ``views``: a list of (B, C, H, W) tensors, one per position (views of different sizes are
    fine as long as a position always has the same size).

    Inside the data modules' loaders (:class:`~ssl_lightning.data.seeding.SeededDataset`) each
    view ``v`` runs with the global torch RNG seeded by ``view_seed(sample seed, v)``, so the
    views are a pure function of (seed, epoch, sample index, view) whatever the pipelines are.

    Args:
        transforms: One callable per view, each mapping an image to a (C, H, W) tensor.
    """

    #: How many of the views, at the end of the list, are weak (:func:`weak_augmentation`).
    weak_views: int = 0

    def __init__(self, transforms: Sequence[Callable[..., Any]]) -> None:
        if len(transforms) == 0:
            raise ValueError("A MultiViewTransform needs at least one view pipeline, got none.")
        self.transforms = list(transforms)

    @property
    def num_views(self) -> int:
        """Number of views returned per image."""
        return len(self.transforms)

    def __call__(self, image: Any) -> list[Tensor]:
        seed = active_sample_seed()
        if seed is None:
            return [transform(image) for transform in self.transforms]
        views = []
        for view, transform in enumerate(self.transforms):
            torch.default_generator.manual_seed(view_seed(seed, view))
            views.append(transform(image))
        return views

    def __repr__(self) -> str:
        lines = "\n".join(f"  view {i}: {t}" for i, t in enumerate(self.transforms))
        return f"{type(self).__name__}(\n{lines}\n)"


class SimCLRViews(MultiViewTransform):
    """``num_views`` independent draws of the SimCLR augmentation (Chen et al., 2020).

    Arguments left as ``None`` take the preset's value (see :data:`PRESETS`).

    Args:
        preset: ``"cifar"`` (any image resized to 32 px first, 32 px crops, s=0.5, no blur) or
            ``"imagenet"`` (224 px crops of the image as it is, s=1.0, blur 0.5).
        num_views: Number of views per image.
        crop_size: Crop side; preset default if None.
        crop_scale: Area range of the random resized crop.
        jitter_strength: Colour-distortion strength ``s``; preset default if None.
        jitter_p: Probability of the colour jitter.
        grayscale_p: Probability of grayscale conversion.
        blur_p: Probability of Gaussian blur; preset default if None.
        solarize_p: Probability of solarisation.
        mean: Normalisation mean; preset default if None.
        std: Normalisation standard deviation; preset default if None.
        jitter: Explicit (brightness, contrast, saturation, hue) of the colour jitter instead of
            the ``jitter_strength`` rule (BYOL / ReSSL: (0.4, 0.4, 0.2, 0.1)).
        weak_views: Weak views (:func:`weak_augmentation`) appended after the ``num_views``
            views (ReSSL's teacher view: ``num_views=1, weak_views=1``).
        weak_crop_scale: Area range of the weak views' crop (ReSSL: (0.2, 1)).
    """

    def __init__(
        self,
        preset: PresetName = "cifar",
        num_views: int = 2,
        crop_size: int | None = None,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        jitter_strength: float | None = None,
        jitter_p: float = 0.8,
        grayscale_p: float = 0.2,
        blur_p: float | None = None,
        solarize_p: float = 0.0,
        mean: Triple | None = None,
        std: Triple | None = None,
        jitter: tuple[float, float, float, float] | None = None,
        weak_views: int = 0,
        weak_crop_scale: tuple[float, float] = (0.2, 1.0),
    ) -> None:
        _check_positive("num_views", num_views)
        p = get_preset(preset)
        crop = crop_size if crop_size is not None else p.crop_size
        mean = mean if mean is not None else p.mean
        std = std if std is not None else p.std
        pipeline = simclr_augmentation(
            crop_size=crop,
            mean=mean,
            std=std,
            crop_scale=crop_scale,
            jitter_strength=jitter_strength if jitter_strength is not None else p.jitter_strength,
            jitter_p=jitter_p,
            grayscale_p=grayscale_p,
            blur_p=blur_p if blur_p is not None else p.blur_p,
            solarize_p=solarize_p,
            jitter=jitter,
            resize=crop if p.resize_first else None,
        )
        weak = weak_augmentation(crop, mean, std, weak_crop_scale,
                                 resize=crop if p.resize_first else None)
        super().__init__([pipeline] * num_views + [weak] * check_weak_views(weak_views))
        self.weak_views = weak_views


class EvalTransform:
    """Deterministic single view for evaluation: resize, centre crop, normalise.

    Args:
        preset: ``"cifar"`` (32 -> 32, i.e. unchanged for CIFAR images) or ``"imagenet"``
            (resize to 256, centre crop 224).
        crop_size: Side of the centre crop; preset default if None.
        resize_size: Shorter side after resizing; preset default if None.
        mean: Normalisation mean; preset default if None.
        std: Normalisation standard deviation; preset default if None.
    """

    def __init__(
        self,
        preset: PresetName = "cifar",
        crop_size: int | None = None,
        resize_size: int | None = None,
        mean: Triple | None = None,
        std: Triple | None = None,
    ) -> None:
        p = get_preset(preset)
        crop = crop_size if crop_size is not None else p.crop_size
        resize = resize_size if resize_size is not None else p.resize_size
        _check_positive("crop_size", crop)
        if resize < crop:
            raise ValueError(f"resize_size ({resize}) must be >= crop_size ({crop}).")
        means = [float(v) for v in (mean if mean is not None else p.mean)]
        stds = [float(v) for v in (std if std is not None else p.std)]
        #: What the transform does, as plain values (recorded in checkpoints:
        #: :mod:`ssl_lightning.data.preprocessing`).
        self.settings: dict[str, Any] = {
            "preset": preset, "image_reader": "rgb", "crop_size": crop, "resize_size": resize,
            "interpolation": "bilinear", "channels": 3, "mean": means, "std": stds,
            "normalization": "x / 255, then (x - mean) / std per channel"}
        self.transform = v2.Compose([
            v2.ToImage(),
            v2.Resize(resize, antialias=True),
            v2.CenterCrop(crop),
            *_to_normalized_tensor(means, stds),
        ])

    def __call__(self, image: Any) -> Tensor:
        return self.transform(image)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform})"


class LinearEvalTransform(MultiViewTransform):
    """Supervised training augmentation for linear evaluation, as one view.

    CIFAR: resize to a 32 px square (a no-op on CIFAR images), random 32 px crop with 4 px zero
    padding + flip; ImageNet: random resized crop 224 +
    flip (the standard linear-evaluation protocol, e.g. SimCLR Appendix B.5). It returns a
    one-element list so that training batches keep the ``(views, targets)`` shape.

    Args:
        preset: ``"cifar"`` or ``"imagenet"``.
        crop_size: Crop side; preset default if None.
        mean: Normalisation mean; preset default if None.
        std: Normalisation standard deviation; preset default if None.
    """

    def __init__(
        self,
        preset: PresetName = "cifar",
        crop_size: int | None = None,
        mean: Triple | None = None,
        std: Triple | None = None,
    ) -> None:
        p = get_preset(preset)
        crop = crop_size if crop_size is not None else p.crop_size
        _check_positive("crop_size", crop)
        crop_step = (v2.RandomCrop(crop, padding=4) if preset == "cifar"
                     else v2.RandomResizedCrop(crop, antialias=True))
        pipeline = v2.Compose([
            *square_resize(crop if p.resize_first else None),
            v2.ToImage(),
            crop_step,
            v2.RandomHorizontalFlip(),
            *_to_normalized_tensor(mean if mean is not None else p.mean,
                                   std if std is not None else p.std),
        ])
        super().__init__([pipeline])
