"""Multi-crop views for PaKA across crops (lightly-train's ``dinov31`` view layout).

"Patch-Level Kernel Alignment for Dense Self-Supervised Learning", arXiv 2509.05606 (2025), §4:
the student's local crops are compared with an augmentation-free teacher's global crop they lie
in ("Global-Local Intersection Maximization", "Augmentation-free Teacher"). :class:`PaKAViews`
returns, per image,

``[global_1, global_2, local_1..L, clean_1, clean_2, paka_1..K, box_g1, box_g2, box_p1..K]``:

- the views of :class:`~ssl_lightning.data.multicrop.MultiCropViews` (the same draws), for DINO's
  and iBOT's terms;
- ``clean_1``, ``clean_2``: the two global crops again (same crop box and flip), resized and
  normalised only, with no photometric augmentation (the teacher's PaKA input);
- ``paka_k``: K local crops at the local size, each drawn inside global crop ``k mod 2``
  (lightly-train's ``sample_high_overlap_box``: an area of 5-40 % of the global crop's, aspect
  ratio in [3/4, 4/3], a uniform position inside it, so the crop lies wholly in its global
  crop), flipped with probability 0.5, then the local crops' photometric augmentation;
- the crop boxes (5,) of the two global crops and of the K PaKA crops (``LocatedViews``' format:
  ``top, left, height, width, flipped`` in pixels of the image).

Every random draw comes from the global torch generator, seeded per sample and view as
:class:`~ssl_lightning.data.transforms.MultiViewTransform` does (view index = position in the list
above), so the views are a pure function of the sample's seed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

from ssl_lightning.data.located_views import _LocatedPipeline
from ssl_lightning.data.multicrop import Dataset, Interpolation, Jitter, MultiCropViews, Recipe
from ssl_lightning.data.seeding import active_sample_seed, view_seed
from ssl_lightning.data.transforms import Triple

#: Area of a PaKA crop as a fraction of its global crop's, and its aspect-ratio range
#: (lightly-train's ``_LOCAL_AREA_MIN``/``_LOCAL_AREA_MAX``; aspect 3/4 to 4/3).
PAKA_AREA = (0.05, 0.40)
PAKA_RATIO = (3 / 4, 4 / 3)


def _uniform(low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(1, dtype=torch.float64))


def box_inside(parent: Tensor) -> tuple[int, int, int, int]:
    """A crop ``(top, left, height, width)`` inside ``parent`` (a box (5,)), from the global
    torch generator: area fraction in :data:`PAKA_AREA`, aspect in :data:`PAKA_RATIO`."""
    top, left, height, width = (int(round(float(v))) for v in parent[:4])
    area = _uniform(*PAKA_AREA) * height * width
    aspect = _uniform(*PAKA_RATIO)
    w = min(max(1, round(math.sqrt(area * aspect))), width)
    h = min(max(1, round(math.sqrt(area / aspect))), height)
    y = top + int(torch.randint(0, height - h + 1, (1,)))
    x = left + int(torch.randint(0, width - w + 1, (1,)))
    return y, x, h, w


class PaKAViews(MultiCropViews):
    """:class:`~ssl_lightning.data.multicrop.MultiCropViews` plus PaKA's clean global crops,
    high-overlap local crops and crop boxes (module docstring).

    Args:
        paka_local_crops: K, the PaKA local crops (lightly-train's ``paka_num_local``: 8).
        recipe, dataset, num_local_crops, global_size, local_size, global_scale, local_scale,
            jitter, interpolation, mean, std: As :class:`MultiCropViews` (no weak views).
    """

    def __init__(
        self,
        paka_local_crops: int = 8,
        recipe: Recipe = "dino",
        dataset: Dataset = "cifar",
        num_local_crops: int | None = None,
        global_size: int | None = None,
        local_size: int | None = None,
        global_scale: tuple[float, float] | None = None,
        local_scale: tuple[float, float] | None = None,
        jitter: Jitter | None = None,
        interpolation: Interpolation | None = None,
        mean: Triple | None = None,
        std: Triple | None = None,
    ) -> None:
        if paka_local_crops < 1:
            raise ValueError(f"paka_local_crops must be >= 1, got {paka_local_crops}.")
        super().__init__(recipe, dataset, num_local_crops, global_size, local_size,
                         global_scale, local_scale, jitter, interpolation, mean, std)
        self.paka_local_crops = paka_local_crops
        self._globals = [_LocatedPipeline(t) for t in self.transforms[:2]]
        local = self.transforms[2] if self.num_local_crops else None
        self._local = _LocatedPipeline(local) if local is not None else None

    def _seed(self, seed: int | None, view: int) -> None:
        if seed is not None:
            torch.default_generator.manual_seed(view_seed(seed, view))

    def __call__(self, image: Any) -> list[Tensor]:  # type: ignore[override]
        if self._local is None:
            raise ValueError("PaKAViews needs num_local_crops >= 1: the PaKA crops take the "
                             "local crops' size and augmentation.")
        seed = active_sample_seed()
        views: list[Tensor] = []
        boxes: list[Tensor] = []
        for view, pipeline in enumerate(self._globals):
            self._seed(seed, view)
            crop, box = pipeline(image)
            views.append(crop)
            boxes.append(box)
        for view, transform in enumerate(self.transforms[2:], start=2):
            self._seed(seed, view)
            views.append(transform(image))
        for g, pipeline in enumerate(self._globals):  # the clean renders: no random draw
            views.append(self._render(pipeline, image, boxes[g], photometric=False))
        first = len(views)
        for k in range(self.paka_local_crops):
            self._seed(seed, first + k)
            top, left, height, width = box_inside(boxes[k % 2])
            flipped = float(torch.rand(1) < self._local.flip.p)
            box = torch.tensor([top, left, height, width, flipped], dtype=torch.float32)
            views.append(self._render(self._local, image, box, photometric=True))
            boxes.append(box)
        return views + boxes

    @staticmethod
    def _render(pipeline: _LocatedPipeline, image: Any, box: Tensor, photometric: bool
                ) -> Tensor:
        """``image`` cut by ``box`` at the pipeline's crop size and interpolation, flipped as
        the box says, then the pipeline's photometric steps (or only its normalisation)."""
        top, left, height, width = (int(v) for v in box[:4])
        crop = TF.resized_crop(pipeline.before(image), top, left, height, width,
                               list(pipeline.crop.size), interpolation=pipeline.crop.interpolation,
                               antialias=True)
        if box[4] > 0.5:
            crop = TF.horizontal_flip(crop)
        after = pipeline.after
        return after(crop) if photometric else after.transforms[-1](crop)
