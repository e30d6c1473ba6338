"""Views with the Felzenszwalb segments of the original image under each of them: DetCon's
default masks (Hénaff et al., ICCV 2021, §3.2).

:class:`FelzenszwalbViews` segments the image once, before any augmentation
(:class:`~ssl_lightning.data.felzenszwalb.FelzenszwalbSegmenter`, on the image the crop boxes
refer to), draws the views and crop boxes of :class:`~ssl_lightning.data.located_views.
LocatedViews` (the same draws, so the views are LocatedViews' views), and cuts each view's segment
map from the image's with the view's crop box and flip
(:func:`~ssl_lightning.data.located_views.crop_segment_map`, the positions the grid masks use).
The views are followed by the segment maps, ``[view_0, ..., view_{V-1}, segments_0, ...]``, each
(crop, crop) int64 with the image's segment ids: the same segment has the same id in every view.
DetCon-S / DetCon-B with ``sampled_masks: 16`` sample their masks among them.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor

from ssl_lightning.data.felzenszwalb import FelzenszwalbSegmenter
from ssl_lightning.data.located_views import LocatedViews, _LocatedPipeline, crop_segment_map
from ssl_lightning.data.transforms import PresetName


class FelzenszwalbViews(LocatedViews):
    """:class:`~ssl_lightning.data.located_views.LocatedViews`' views followed by their
    Felzenszwalb segment maps (module docstring).

    Args:
        preset: ``"cifar"`` or ``"imagenet"``, as LocatedViews (the other view arguments too).
        num_views: Views (and segment maps) per image.
        crop_size: Crop side.
        crop_scale: Area range of the random resized crop.
        jitter_strength: Colour-distortion strength ``s``.
        jitter_p: Probability of the colour jitter.
        grayscale_p: Probability of grayscale conversion.
        blur_p: Probability of Gaussian blur.
        solarize_p: Probability of solarisation.
        mean: Normalisation mean.
        std: Normalisation standard deviation.
        scale: Felzenszwalb scale (the authors: 1000 on ImageNet images).
        sigma: Smoothing σ before segmenting (0.8).
        min_size: Smallest segment in pixels (1000 on ImageNet images).
        cache_size: Segment maps kept in memory per data-loading process (see
            :class:`~ssl_lightning.data.felzenszwalb.FelzenszwalbSegmenter`).
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
        scale: float = 1000.0,
        sigma: float = 0.8,
        min_size: int = 1000,
        cache_size: int = 4096,
    ) -> None:
        super().__init__(preset, num_views, crop_size, crop_scale, jitter_strength, jitter_p,
                         grayscale_p, blur_p, solarize_p, mean, std)
        self.segmenter = FelzenszwalbSegmenter(scale, sigma, min_size, cache_size)

    def __call__(self, image: Any) -> list[Tensor]:  # type: ignore[override]
        # every pipeline starts with the same deterministic steps (the preset's square resize)
        segments = self.segmenter(cast(_LocatedPipeline, self.transforms[0]).before(image))
        located = super().__call__(image)
        count = self.num_views
        views, boxes = located[:count], located[count:]
        return views + [crop_segment_map(segments, box, *view.shape[-2:])
                        for view, box in zip(views, boxes, strict=True)]

    def __repr__(self) -> str:
        return f"{super().__repr__()}\n  segments: {self.segmenter!r}"
