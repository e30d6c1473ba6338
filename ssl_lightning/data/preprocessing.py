"""How a backbone was fed, recorded in its checkpoint, and read back by the evaluation tools.

A pre-training run saves, under the checkpoint's :data:`PREPROCESSING_KEY`, the settings of the
evaluation transform its data module used (:class:`~ssl_lightning.data.transforms.EvalTransform`
or :class:`~ssl_lightning.data.multichannel_views.MultiChannelEval`): preset, image reader,
crop and resize sizes, interpolation, channel count, channel mean/std and the normalisation, as
plain values (``torch.load(weights_only=True)`` reads them). ``embed``, ``export``,
``LinearEval`` and ``KNNEval`` read it back (:func:`resolve_preprocessing`): they use it by
default, print one line saying what they use, and warn when a flag overrides it with something
the backbone was not trained on; a checkpoint without the record keeps the old defaults, with a
warning that they are a guess.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ssl_lightning.data.multichannel_views import MultiChannelEval
from ssl_lightning.data.transforms import EvalTransform, get_preset

#: Checkpoint entry with the preprocessing record.
PREPROCESSING_KEY = "preprocessing"
#: The settings a flag may override, with the flag's name (the ``embed`` / ``export`` spelling).
OVERRIDES = {"preset": "--preset", "image_reader": "--image-reader", "crop_size": "--crop-size",
             "resize_size": "--resize-size", "mean": "--mean", "std": "--std"}
#: What a checkpoint without a record is evaluated with (the tools' defaults before the record).
GUESS = {"preset": "cifar", "image_reader": "rgb"}


class PreprocessingWarning(UserWarning):
    """The preprocessing differs from (or is not known from) the checkpoint's record."""


def preprocessing_record(datamodule: Any) -> dict[str, Any] | None:
    """The record of ``datamodule``'s evaluation transform (a copy of its ``settings``), or
    None for a data module without one of the recorded transforms (a transform of one's own)."""
    settings = getattr(getattr(datamodule, "eval_transform", None), "settings", None)
    return _plain(dict(settings)) if isinstance(settings, Mapping) else None


def _plain(value: Any) -> Any:
    """``value`` as str/int/float/bool/list/dict only (loadable with ``weights_only=True``)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return float(value)


def describe(settings: Mapping[str, Any]) -> str:
    """One line for people: ``rgb images (preset cifar), resize 64, centre crop 64, ...``."""
    def numbers(values: Any) -> str:
        return "[" + ", ".join(f"{float(v):.4g}" for v in values) + "]"

    return (f"{settings['image_reader']} images ({settings['channels']} channels, preset "
            f"{settings['preset']}), resize {settings['resize_size']}, centre crop "
            f"{settings['crop_size']}, {settings['interpolation']}, mean "
            f"{numbers(settings['mean'])}, std {numbers(settings['std'])}")


def resolve_preprocessing(record: Mapping[str, Any] | None, source: str,
                          **overrides: Any) -> dict[str, Any]:
    """The settings to evaluate with: ``record`` (the checkpoint's) updated by the ``overrides``
    that are not None (keys of :data:`OVERRIDES`); without a record, :data:`GUESS` updated by
    them. A ``preset`` override resets the sizes and statistics to that preset's (unless they
    are overridden too).

    Warns (:class:`PreprocessingWarning`) for each override that differs from the record, and
    once when there is no record. ``source`` names the checkpoint in the messages.

    Raises:
        ValueError: an unknown preset or image reader, or mean/std for RGB images.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - set(OVERRIDES)
    if unknown:
        raise TypeError(f"resolve_preprocessing got unknown settings {sorted(unknown)}.")
    if record is None:
        flags = ", ".join(OVERRIDES.values())
        warnings.warn(
            f"{source} does not record how its backbone was fed (it was written before "
            "checkpoints recorded it, or without a data module), so the preprocessing is a guess"
            f": {', '.join(f'{k} {v}' for k, v in {**GUESS, **given}.items())}. Set it with "
            f"{flags} to match the pre-training data.", PreprocessingWarning, stacklevel=2)
        base: dict[str, Any] = dict(GUESS)
    else:
        base = dict(record)
        for key, value in given.items():
            trained = record.get(key)
            if differs(value, trained):
                warnings.warn(
                    f"{OVERRIDES[key]} {_show(value)} overrides the checkpoint's {key} "
                    f"{_show(trained)}: the backbone was not trained on this preprocessing "
                    f"({source}). Drop {OVERRIDES[key]} to use the checkpoint's.",
                    PreprocessingWarning, stacklevel=2)
    for key, dependent in _DEPENDENT.items():
        if key in given and differs(given[key], base.get(key)):
            base = {k: v for k, v in base.items() if k not in dependent}
    return build_settings({**base, **given})


#: The settings that follow from another one: changing it drops the recorded values of these.
_DEPENDENT = {"image_reader": ("preset", "crop_size", "resize_size", "mean", "std"),
              "preset": ("crop_size", "resize_size", "mean", "std"),
              "crop_size": ("resize_size",)}


def differs(value: Any, trained: Any) -> bool:
    """Whether a setting differs from the recorded one (lists of floats up to 1e-6)."""
    if isinstance(value, (list, tuple)) and isinstance(trained, (list, tuple)):
        return len(value) != len(trained) or any(
            abs(float(a) - float(b)) > 1e-6 * max(1.0, abs(float(b)))
            for a, b in zip(value, trained, strict=True))
    return value != trained


def _show(value: Any) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in value) + "]" \
        if isinstance(value, (list, tuple)) else str(value)


def build_settings(partial: Mapping[str, Any]) -> dict[str, Any]:
    """The complete settings of ``partial`` (missing values from its preset, or for arrays from
    the crop), validated by building the transform."""
    return dict(eval_transform(partial).settings)


def eval_transform(settings: Mapping[str, Any]) -> EvalTransform:
    """The evaluation transform of (possibly partial) settings.

    Raises:
        ValueError: an unknown image reader or preset, mean/std for RGB images given without
            both, or array images without mean and std.
    """
    reader = settings.get("image_reader", "rgb")
    mean, std = settings.get("mean"), settings.get("std")
    if reader == "array":
        if mean is None or std is None:
            raise ValueError("--image-reader array needs the pre-training data's per-channel "
                             "--mean and --std (python -m ssl_lightning channel-stats --images "
                             "DIR).")
        preset = settings.get("preset")
        crop = settings.get("crop_size") or (get_preset(preset).crop_size
                                             if preset in ("cifar", "imagenet") else 224)
        return MultiChannelEval(mean, std, crop_size=crop, resize_size=settings.get("resize_size"))
    if reader != "rgb":
        raise ValueError(f"image_reader must be 'rgb' or 'array', got {reader!r}.")
    preset = settings.get("preset", "cifar")
    crop = settings.get("crop_size")
    resize = settings.get("resize_size")
    if crop is not None and resize is None:
        resize = crop  # a crop size alone: the image resized to it, then its centre square
    return EvalTransform(preset, crop_size=crop, resize_size=resize,
                         mean=None if mean is None else tuple(mean),  # type: ignore[arg-type]
                         std=None if std is None else tuple(std))  # type: ignore[arg-type]
