"""Multi-crop views: 2 global crops and V local crops at a lower resolution.

Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster Assignments"
(SwAV), NeurIPS 2020, §3.2: 2×224 px crops of scale (0.14, 1) and V×96 px crops of scale
(0.05, 0.14), colour distortion of strength 1 (jitter 0.8, 0.8, 0.8, 0.2) and Gaussian blur
(p=0.5) on every crop, bilinear resizing (official code: ``src/multicropdataset.py``). Caron et
al., "Emerging Properties in Self-Supervised Vision Transformers" (DINO), ICCV 2021, Appendix and
the official ``DataAugmentationDINO``: global scale (0.4, 1) and local (0.05, 0.4), resized with
*bicubic* interpolation; colour jitter (brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1)
with p=0.8, grayscale 0.2; blur with p=1.0 on the first global crop, 0.1 on the second (plus
solarisation 0.2), 0.5 on the local crops. The CIFAR presets keep the scales and use 32 px /
16 px crops without blur (a 3-pixel blur kernel on a 16 px image removes most of the content).

Views come out ordered ``[global_1, global_2, local_1, ..., local_V]`` (then ``weak_views``
global-size weak views, :func:`~ssl_lightning.data.transforms.weak_augmentation`): the methods
rely on the global crops being first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ssl_lightning.data.transforms import (
    MultiViewTransform,
    Triple,
    check_weak_views,
    get_preset,
    simclr_augmentation,
    weak_augmentation,
)

Recipe = Literal["dino", "swav"]
Dataset = Literal["cifar", "imagenet"]
Interpolation = Literal["bilinear", "bicubic"]
Jitter = tuple[float, float, float, float]


@dataclass(frozen=True)
class MultiCropRecipe:
    """Scales, sizes and per-crop photometric settings of one multi-crop recipe."""

    global_scale: tuple[float, float]
    local_scale: tuple[float, float]
    num_local_crops: int
    jitter: Jitter  # brightness, contrast, saturation, hue
    blur_p: tuple[float, float, float]  # global 1, global 2, local
    solarize_p: tuple[float, float, float]
    interpolation: Interpolation


RECIPES: dict[str, MultiCropRecipe] = {
    "dino": MultiCropRecipe((0.4, 1.0), (0.05, 0.4), 10, (0.4, 0.4, 0.2, 0.1), (1.0, 0.1, 0.5),
                            (0.0, 0.2, 0.0), "bicubic"),
    "swav": MultiCropRecipe((0.14, 1.0), (0.05, 0.14), 6, (0.8, 0.8, 0.8, 0.2), (0.5, 0.5, 0.5),
                            (0.0, 0.0, 0.0), "bilinear"),
}
SIZES: dict[str, tuple[int, int]] = {"cifar": (32, 16), "imagenet": (224, 96)}


class MultiCropViews(MultiViewTransform):
    """2 global + ``num_local_crops`` local views of one image (DINO / SwAV multi-crop).

    Arguments left as ``None`` take the recipe's (scales, V) or the dataset's (sizes) value.

    Args:
        recipe: ``"dino"`` or ``"swav"`` (scales, jitter, blur/solarisation per crop).
        dataset: ``"cifar"`` (32/16 px, no blur, CIFAR statistics) or ``"imagenet"`` (224/96 px).
        num_local_crops: V, the number of local crops (DINO 10, SwAV 6); 0 gives 2 views.
        global_size: Side of the global crops.
        local_size: Side of the local crops.
        global_scale: Area range of the global crops.
        local_scale: Area range of the local crops.
        jitter: Colour jitter (brightness, contrast, saturation, hue) with p=0.8; the recipe's
            (DINO (0.4, 0.4, 0.2, 0.1), SwAV (0.8, 0.8, 0.8, 0.2)) if None.
        interpolation: Resampling of the crops; the recipe's (DINO bicubic, SwAV bilinear) if
            None.
        mean: Normalisation mean; dataset default if None.
        std: Normalisation standard deviation; dataset default if None.
        weak_views: Weak global-size views appended after the local crops (ReSSL's teacher view).
        weak_crop_scale: Area range of the weak views' crop (ReSSL: (0.2, 1)).
    """

    def __init__(
        self,
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
        weak_views: int = 0,
        weak_crop_scale: tuple[float, float] = (0.2, 1.0),
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(
                f"Unknown multi-crop recipe {recipe!r}; choose one of {sorted(RECIPES)}."
            )
        if dataset not in SIZES:
            raise ValueError(f"Unknown dataset {dataset!r}; choose one of {sorted(SIZES)}.")
        r, stats = RECIPES[recipe], get_preset(dataset)
        n_local = r.num_local_crops if num_local_crops is None else num_local_crops
        if n_local < 0:
            raise ValueError(f"num_local_crops must be >= 0, got {n_local}.")
        g_size = global_size if global_size is not None else SIZES[dataset][0]
        l_size = local_size if local_size is not None else SIZES[dataset][1]
        blur = r.blur_p if dataset == "imagenet" else (0.0, 0.0, 0.0)

        def crop(size: int, scale: tuple[float, float], which: int):  # type: ignore[no-untyped-def]
            return simclr_augmentation(
                size, mean if mean is not None else stats.mean,
                std if std is not None else stats.std, crop_scale=scale,
                jitter=jitter if jitter is not None else r.jitter, blur_p=blur[which],
                solarize_p=r.solarize_p[which],
                interpolation=interpolation if interpolation is not None else r.interpolation,
            )

        g_scale = global_scale if global_scale is not None else r.global_scale
        l_scale = local_scale if local_scale is not None else r.local_scale
        local = crop(l_size, l_scale, 2)
        weak = weak_augmentation(g_size, mean if mean is not None else stats.mean,
                                 std if std is not None else stats.std, weak_crop_scale)
        super().__init__([crop(g_size, g_scale, 0), crop(g_size, g_scale, 1)] + [local] * n_local
                         + [weak] * check_weak_views(weak_views))
        self.weak_views = weak_views
        self.num_global_crops = 2
        self.num_local_crops = n_local
        self.global_size, self.local_size = g_size, l_size
