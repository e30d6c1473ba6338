"""The asymmetric BYOL augmentation: two differently distributed views.

Grill et al., "Bootstrap Your Own Latent", NeurIPS 2020, Appendix B, Table 6: both views use a
random resized crop (scale 0.08-1), horizontal flip, colour jitter (p=0.8) and grayscale
(p=0.2); the first view is always blurred and never solarised (blur p=1.0, solarize p=0.0), the
second rarely blurred and sometimes solarised (blur p=0.1, solarize p=0.2). MoCo v3 uses the same
recipe (Chen, Xie & He, 2021, §4).

On 32 px CIFAR images the blur is off by default (p = 0 for both views): a 3×3 kernel (10 % of
the crop) on a 32 px image removes most of the content, SimCLR drops the blur for CIFAR
(Appendix B.9) and solo-learn's CIFAR BYOL recipe (``scripts/pretrain/cifar/augmentations/
asymmetric.yaml``) uses blur 0.0 / 0.0 with solarisation 0.0 / 0.2, as here.

Built from :func:`~ssl_lightning.data.transforms.simclr_augmentation` with BYOL's explicit colour
jitter: brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1.
"""

from __future__ import annotations

from ssl_lightning.data.transforms import (
    MultiViewTransform,
    PresetName,
    Triple,
    get_preset,
    simclr_augmentation,
)


class BYOLViews(MultiViewTransform):
    """Two views with the BYOL per-view blur and solarisation probabilities.

    Arguments left as ``None`` take the preset's value.

    Args:
        preset: ``"cifar"`` (32 px crops, CIFAR statistics) or ``"imagenet"`` (224 px).
        crop_size: Crop side; preset default if None.
        crop_scale: Area range of the random resized crop.
        jitter: Colour jitter (brightness, contrast, saturation, hue); BYOL's by default.
        blur_p: Gaussian-blur probability of view 1 and view 2; None: BYOL's 1.0 and 0.1 for
            ``"imagenet"``, 0.0 and 0.0 for ``"cifar"`` (see the module docstring).
        solarize_p: Solarisation probability of view 1 and view 2 (BYOL: 0.0 and 0.2).
        mean: Normalisation mean; preset default if None.
        std: Normalisation standard deviation; preset default if None.
    """

    def __init__(
        self,
        preset: PresetName = "cifar",
        crop_size: int | None = None,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1),
        blur_p: tuple[float, float] | None = None,
        solarize_p: tuple[float, float] = (0.0, 0.2),
        mean: Triple | None = None,
        std: Triple | None = None,
    ) -> None:
        if blur_p is None:
            blur_p = (0.0, 0.0) if preset == "cifar" else (1.0, 0.1)
        if len(blur_p) != 2 or len(solarize_p) != 2:
            raise ValueError(f"blur_p and solarize_p need one probability per view (2 each), got "
                             f"{blur_p} and {solarize_p}.")
        p = get_preset(preset)
        super().__init__([
            simclr_augmentation(
                crop_size=crop_size if crop_size is not None else p.crop_size,
                mean=mean if mean is not None else p.mean,
                std=std if std is not None else p.std,
                crop_scale=crop_scale,
                jitter=jitter,
                blur_p=blur,
                solarize_p=solarize,
            )
            for blur, solarize in zip(blur_p, solarize_p, strict=True)
        ])
