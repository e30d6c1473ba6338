"""DetCon's Felzenszwalb masks: the segments of coloured rectangles are the rectangles, a view's
segment map is the crop and flip of the original image's map with the view's box (the same as
cropping and flipping the image first), every view names a segment by the same id, and a missing
scikit-image is one line. The masks in DetCon: tests/methods/test_detcon_s.py."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from ssl_lightning.data import FelzenszwalbViews, LocatedViews
from ssl_lightning.data.felzenszwalb import FelzenszwalbSegmenter
from ssl_lightning.data.located_views import crop_segment_map

pytest.importorskip("skimage")
pytestmark = pytest.mark.usefixtures("one_thread")

#: (top, left, bottom, right, colour) of four rectangles tiling a 32 px image.
RECTANGLES = [(0, 0, 12, 20, (200, 30, 30)), (0, 20, 12, 32, (20, 200, 40)),
              (12, 0, 32, 9, (30, 40, 220)), (12, 9, 32, 32, (250, 250, 0))]
#: Parameters that split clean colour edges and merge nothing else (σ = 0: no smoothing).
CLEAN = dict(scale=100.0, sigma=0.0, min_size=10)


def _rectangles() -> tuple[np.ndarray, Tensor]:
    image = np.zeros((32, 32, 3), np.uint8)
    truth = torch.zeros(32, 32, dtype=torch.long)
    for k, (top, left, bottom, right, colour) in enumerate(RECTANGLES):
        image[top:bottom, left:right] = colour
        truth[top:bottom, left:right] = k
    return image, truth


def _same_partition(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` label the same regions (equal up to a one-to-one renaming of ids)."""
    pairs = set(zip(a.flatten().tolist(), b.flatten().tolist(), strict=True))
    return len(pairs) == len(set(a.flatten().tolist())) == len(set(b.flatten().tolist()))


def test_the_segments_of_coloured_rectangles_are_the_rectangles() -> None:
    image, truth = _rectangles()
    segmenter = FelzenszwalbSegmenter(**CLEAN)
    segments = segmenter(Image.fromarray(image))
    assert segments.dtype == torch.int64 and _same_partition(segments, truth)
    assert len(segments.unique()) == 4
    assert torch.equal(segmenter(torch.from_numpy(image).permute(2, 0, 1)), segments)  # cached
    # the authors' ImageNet parameters keep no segment under 1000 px: one segment at 32 px
    assert FelzenszwalbSegmenter()(image).unique().tolist() == [0]


def test_a_views_segment_map_is_the_crop_and_flip_of_the_images_map() -> None:
    """``crop_segment_map`` with a view's box equals cropping and flipping the image first
    (torchvision's nearest resized crop of the segment ids as pixels), for the boxes the views
    draw, mirrored or not, at 32 and 16 px."""
    _, truth = _rectangles()
    ids = torch.arange(32 * 32).view(32, 32)  # every pixel its own segment: any shift shows
    for crop in (32, 16):
        views = LocatedViews("cifar", num_views=16, crop_size=crop)
        torch.manual_seed(crop)
        boxes = views(Image.fromarray(_rectangles()[0]))[16:]
        assert {float(b[4]) for b in boxes} == {0.0, 1.0}
        for box in boxes:
            top, left, height, width = (int(v) for v in box[:4])
            for segments in (truth, ids):
                expected = TF.resized_crop(segments[None].float(), top, left, height, width,
                                           [crop, crop], InterpolationMode.NEAREST_EXACT)[0]
                if box[4] > 0.5:
                    expected = TF.horizontal_flip(expected)
                assert torch.equal(crop_segment_map(segments, box, crop, crop),
                                   expected.long()), box


class _SegmentsOfTheViews(FelzenszwalbViews):
    """Known-bad: segments each augmented view instead of the original image."""

    def __call__(self, image: object) -> list[Tensor]:  # type: ignore[override]
        views = LocatedViews.__call__(self, image)[:self.num_views]
        pixels = [(v * 60 + 128).clamp(0, 255).to(torch.uint8) for v in views]
        return views + [self.segmenter(p) for p in pixels]


def _check_views_carry_the_originals_segments(transform: FelzenszwalbViews) -> None:
    image, _ = _rectangles()
    segments = FelzenszwalbSegmenter(**CLEAN)(image)
    for seed in range(6):
        torch.manual_seed(seed)
        got = transform(Image.fromarray(image))
        torch.manual_seed(seed)
        located = LocatedViews("cifar", num_views=2)(Image.fromarray(image))
        for view in range(2):
            assert torch.equal(got[view], located[view])  # the same draws as LocatedViews
            assert torch.equal(got[2 + view],
                               crop_segment_map(segments, located[2 + view], 32, 32)), seed


def test_the_views_carry_the_original_images_segments_with_one_id_per_segment() -> None:
    _check_views_carry_the_originals_segments(FelzenszwalbViews("cifar", **CLEAN))
    with pytest.raises(AssertionError):  # known-bad: segmenting the augmented views
        _check_views_carry_the_originals_segments(_SegmentsOfTheViews("cifar", **CLEAN))


def test_without_scikit_image_the_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "skimage.segmentation", None)
    with pytest.raises(ImportError, match=r"pip install ssl_lightning\[segments\]"):
        FelzenszwalbViews("cifar")
