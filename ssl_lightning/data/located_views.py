"""Views that say where they come from: the crop box and flip of every view, for the dense
methods that pair locations by their position in the original image (VICRegL).

:class:`LocatedViews` makes the SimCLR views of :class:`~ssl_lightning.data.transforms.SimCLRViews`
and, after the views, one box per view: ``(top, left, height, width, flipped)`` of its random
resized crop in pixels of the image the crop was taken from (after the preset's square resize),
``flipped`` 1.0 when the crop was mirrored. The crop and flip are drawn from the global torch RNG,
which the data modules seed per sample and view (keyed randomness,
:mod:`ssl_lightning.data.seeding`), so a view and its box are one draw. :func:`map_positions`
turns a box into the image positions of a feature map's locations, :func:`crop_segment_map` cuts
a view's segment map from the image's (DetCon's Felzenszwalb masks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchvision.transforms import RandomResizedCrop as CropParams
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from ssl_lightning.data.transforms import MultiViewTransform, PresetName, SimCLRViews

#: Entries of a view's box.
BOX_SIZE = 5


def _compose(steps: list[Any]) -> Any:
    """The steps in order; none (the ImageNet preset starts with the crop): the identity."""
    return v2.Compose(steps) if steps else v2.Identity()


class _LocatedPipeline:
    """One SimCLR pipeline whose random resized crop and flip are drawn here and recorded."""

    def __init__(self, pipeline: v2.Compose) -> None:
        steps = list(pipeline.transforms)
        at = next(i for i, step in enumerate(steps) if isinstance(step, v2.RandomResizedCrop))
        self.before, self.crop, self.flip = _compose(steps[:at]), steps[at], steps[at + 1]
        self.after = _compose(steps[at + 2:])

    def __call__(self, image: Any) -> tuple[Tensor, Tensor]:
        image = self.before(image)
        top, left, height, width = CropParams.get_params(image, list(self.crop.scale),
                                                         list(self.crop.ratio))
        image = TF.resized_crop(image, top, left, height, width, list(self.crop.size),
                                interpolation=self.crop.interpolation, antialias=True)
        flipped = bool(torch.rand(1) < self.flip.p)
        if flipped:
            image = TF.horizontal_flip(image)
        box = torch.tensor([top, left, height, width, float(flipped)], dtype=torch.float32)
        return self.after(image), box

    def __repr__(self) -> str:
        return f"located crop {self.crop.size} scale={self.crop.scale}, flip p={self.flip.p}"


class LocatedViews(MultiViewTransform):
    """SimCLR views followed by their crop boxes: ``[view_0, ..., view_{V-1}, box_0, ...,
    box_{V-1}]``, each box (5,) as in the module docstring.

    Args:
        preset: ``"cifar"`` or ``"imagenet"``; see :class:`~ssl_lightning.data.SimCLRViews`,
            whose arguments the others are too (None: the preset's value).
        num_views: Views (and boxes) per image.
        crop_size: Crop side.
        crop_scale: Area range of the random resized crop.
        jitter_strength: Colour-distortion strength ``s``.
        jitter_p: Probability of the colour jitter.
        grayscale_p: Probability of grayscale conversion.
        blur_p: Probability of Gaussian blur.
        solarize_p: Probability of solarisation.
        mean: Normalisation mean.
        std: Normalisation standard deviation.
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
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
    ) -> None:
        views = SimCLRViews(preset, num_views, crop_size, crop_scale, jitter_strength, jitter_p,
                            grayscale_p, blur_p, solarize_p, mean, std)
        super().__init__([_LocatedPipeline(t) for t in views.transforms])

    def __call__(self, image: Any) -> list[Tensor]:  # type: ignore[override]
        pairs: list[Any] = super().__call__(image)
        return [view for view, _ in pairs] + [box for _, box in pairs]


def map_positions(boxes: Tensor, height: int, width: int) -> Tensor:
    """The image positions (y, x), in pixels, of the centres of a (height, width) feature map's
    locations (row-major, as :func:`~ssl_lightning.losses.dense_matching.map_to_locations`) for
    views cut by ``boxes`` (B, 5) (mirrored views: x mirrored inside the box), (B, h·w, 2)."""
    if boxes.dim() != 2 or boxes.shape[1] != BOX_SIZE:
        raise ValueError(f"Expected crop boxes (B, {BOX_SIZE}) of LocatedViews, got "
                         f"{tuple(boxes.shape)}.")
    dtype = boxes.dtype if boxes.is_floating_point() else torch.float32
    rows = (torch.arange(height, dtype=dtype, device=boxes.device) + 0.5) / height
    cols = (torch.arange(width, dtype=dtype, device=boxes.device) + 0.5) / width
    top, left, box_h, box_w, flipped = boxes.to(dtype).unbind(1)
    cols = torch.where(flipped[:, None] > 0.5, 1 - cols, cols)  # (B, w)
    y = top[:, None] + box_h[:, None] * rows  # (B, h)
    x = left[:, None] + box_w[:, None] * cols  # (B, w)
    return torch.stack(torch.broadcast_tensors(y[:, :, None], x[:, None, :]), dim=-1).flatten(1, 2)


def crop_segment_map(segments: Tensor, box: Tensor, height: int, width: int) -> Tensor:
    """The (height, width) segment map of a view cut from an image's segment map (H, W) by its
    crop box (5,) of :class:`LocatedViews`: each view pixel takes the segment under its centre's
    position in the image (:func:`map_positions` in float64, which also places DetCon's grid
    masks; mirrored views mirrored inside the box): a nearest-neighbour resized crop and flip."""
    if segments.dim() != 2 or segments.is_floating_point():
        raise ValueError(f"Expected an integer segment map (H, W), got "
                         f"{tuple(segments.shape)} of {segments.dtype}.")
    index = map_positions(box.reshape(1, BOX_SIZE).double(), height, width)[0].floor().long()
    rows = index[:, 0].clamp(0, segments.shape[0] - 1)
    cols = index[:, 1].clamp(0, segments.shape[1] - 1)
    return segments[rows, cols].reshape(height, width)
