"""The one-view augmentation of the masked-image methods: random resized crop + flip.

MAE (He et al., CVPR 2022, Appendix A.1, Table 8) pre-trains with RandomResizedCrop (scale
0.2-1, bicubic) and a horizontal flip only; I-JEPA (Assran et al., CVPR 2023; its code) with
RandomResizedCrop of scale 0.3-1 and no flip (``flip_p=0``). Normalised like the other views.
"""

from __future__ import annotations

from torchvision.transforms import InterpolationMode, v2

from ssl_lightning.data.transforms import (
    MultiViewTransform,
    PresetName,
    ToNormalizedTensor,
    Triple,
    get_preset,
)


class MAEViews(MultiViewTransform):
    """One view per image: random resized crop (bicubic), horizontal flip, normalisation.

    Arguments left as ``None`` take the preset's value.

    Args:
        preset: ``"cifar"`` (32 px crops, CIFAR statistics) or ``"imagenet"`` (224 px).
        crop_size: Crop side; preset default if None.
        crop_scale: Area range of the random resized crop (MAE 0.2-1, I-JEPA 0.3-1).
        flip_p: Probability of a horizontal flip (MAE 0.5, I-JEPA 0).
        mean: Normalisation mean; preset default if None.
        std: Normalisation standard deviation; preset default if None.
    """

    def __init__(
        self,
        preset: PresetName = "cifar",
        crop_size: int | None = None,
        crop_scale: tuple[float, float] = (0.2, 1.0),
        flip_p: float = 0.5,
        mean: Triple | None = None,
        std: Triple | None = None,
    ) -> None:
        p = get_preset(preset)
        crop = crop_size if crop_size is not None else p.crop_size
        if crop < 1:
            raise ValueError(f"crop_size must be > 0, got {crop}.")
        if not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {crop_scale}.")
        if not 0.0 <= flip_p <= 1.0:
            raise ValueError(f"flip_p must be a probability in [0, 1], got {flip_p}.")
        super().__init__([v2.Compose([
            v2.RandomResizedCrop(crop, scale=crop_scale,
                                 interpolation=InterpolationMode.BICUBIC, antialias=True),
            v2.RandomHorizontalFlip(p=flip_p),
            ToNormalizedTensor(mean if mean is not None else p.mean,
                               std if std is not None else p.std),
        ])])
