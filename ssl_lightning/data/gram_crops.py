"""Multi-crop views with DINOv3's Gram-teacher crops: the global crops at a higher resolution.

Siméoni et al., "DINOv3", arXiv 2508.10104, 2025, §4.3: the Gram teacher sees the student's
global crops at twice their resolution. As the official ``DataAugmentationDINO`` with
``gram_teacher_no_distortions: false``, each global crop is drawn (random resized crop and
photometric distortions) once at the Gram-teacher size, and the student's global crop is that
crop resized (bicubic, antialiased) to the global size, so both show the same content.

Views come out ``[global_1, global_2, local_1 … local_V, gram_1, gram_2]``
(:class:`~ssl_lightning.methods.DINOv3` takes the last two as the Gram teacher's input).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.data.multicrop import SIZES, MultiCropViews


class GramCropViews(MultiCropViews):
    """:class:`MultiCropViews` plus the 2 global crops at ``gram_size`` for the Gram teacher.

    Args:
        gram_size: Side of the Gram-teacher crops (DINOv3: 2 × ``global_size``); at least
            ``global_size``.
        global_size: Side of the student's global crops; the dataset's if None.
        **kwargs: Other arguments of :class:`MultiCropViews` (recipe, dataset, local crops).
    """

    def __init__(self, gram_size: int, global_size: int | None = None, **kwargs: Any) -> None:
        size = global_size if global_size is not None else SIZES[kwargs.get("dataset",
                                                                             "cifar")][0]
        if gram_size < size:
            raise ValueError(f"gram_size ({gram_size}) must be >= global_size ({size}): the Gram "
                             "teacher sees the global crops at a higher resolution.")
        super().__init__(global_size=gram_size, **kwargs)
        self.global_size, self.gram_size = size, gram_size

    def __call__(self, image: Any) -> list[Tensor]:
        views = super().__call__(image)
        small = [F.interpolate(v[None], size=(self.global_size, self.global_size),
                               mode="bicubic", align_corners=False, antialias=True)[0]
                 for v in views[:2]]
        return small + views[2:] + views[:2]
