"""The preprocessing an evaluation tool uses for a checkpoint: its record
(:mod:`ssl_lightning.data.preprocessing`), overridden by flags, announced in one line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from ssl_lightning._lightning import rank_zero_only, rank_zero_warn
from ssl_lightning.backbones.checkpoint import load_checkpoint
from ssl_lightning.data.checks import train_view_size
from ssl_lightning.data.preprocessing import (
    OVERRIDES,
    PREPROCESSING_KEY,
    PreprocessingWarning,
    describe,
    differs,
    preprocessing_record,
    resolve_preprocessing,
)


def recorded_preprocessing(path: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint's preprocessing record, or None when it has none (older checkpoints)."""
    record = load_checkpoint(path).get(PREPROCESSING_KEY)
    return dict(record) if isinstance(record, Mapping) else None


def checkpoint_preprocessing(path: str | os.PathLike, owner: str,
                             **overrides: Any) -> dict[str, Any]:
    """The settings ``owner`` (e.g. ``"embed"``) uses for the checkpoint at ``path``: its record
    with the ``overrides`` that are not None (warning where they differ from it), or a guess
    for a checkpoint without a record (with a warning); prints one line saying which."""
    record = recorded_preprocessing(path)
    settings = resolve_preprocessing(record, f"checkpoint {os.fspath(path)!r}", **overrides)
    given = any(v is not None for v in overrides.values())
    origin = ("guessed (the checkpoint has no record)" if record is None
              else "the checkpoint's, with overrides" if given else "the checkpoint's")
    print(f"{owner}: preprocessing {origin}: {describe(settings)}")
    return settings


def check_data_preprocessing(owner: str, record: Mapping[str, Any] | None,
                             datamodule: Any, source: str) -> None:
    """For a module evaluating through a data module (``LinearEval``, ``KNNEval``): print the
    preprocessing the data module's evaluation transform applies, and warn when it is not the
    checkpoint's record (naming the recorded settings to configure), or when the checkpoint
    has no record; on global rank 0 only."""
    data = preprocessing_record(datamodule)
    if data is None:
        return  # a transform of one's own: nothing known to compare
    rank_zero_only(print)(f"{owner}: preprocessing of the data module: {describe(data)}")
    if record is None:
        rank_zero_warn(
            f"{source} does not record how its backbone was fed, so the data module's "
            "evaluation transform is a guess; set --data.eval_transform to the pre-training "
            "run's.", category=PreprocessingWarning)
        return
    changed = [key for key in ("image_reader", "crop_size", "resize_size", "channels", "mean",
                               "std") if differs(data.get(key), record.get(key))]
    if changed:
        rank_zero_warn(
            f"{owner}: the data module's evaluation transform differs from the checkpoint's "
            f"record in {', '.join(changed)}: the backbone was trained on "
            f"{describe(record)} ({source}). Set --data.eval_transform to match.",
            category=PreprocessingWarning)


def add_preprocessing_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that override a checkpoint's preprocessing (``embed``, ``export``)."""
    parser.add_argument("--preset", choices=["cifar", "imagenet"], default=None,
                        help="evaluation transform preset (cifar: 32 px, imagenet: 224 px); "
                             "default: the checkpoint's preprocessing")
    parser.add_argument("--crop-size", type=int, default=None,
                        help="override the checkpoint's crop size")
    parser.add_argument("--resize-size", type=int, default=None,
                        help="override the checkpoint's resize size (shorter side)")
    parser.add_argument("--image-reader", choices=["rgb", "array"], default=None,
                        help="rgb, or array: images of any channel count and bit depth (TIFF, "
                             ".npy, 16-bit PNG), normalised by --mean and --std; default: the "
                             "checkpoint's")
    parser.add_argument("--mean", type=float, nargs="+", default=None,
                        help="per-channel mean (default: the checkpoint's)")
    parser.add_argument("--std", type=float, nargs="+", default=None,
                        help="per-channel std (default: the checkpoint's)")


def preprocessing_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The values of :func:`add_preprocessing_flags`' flags, by setting name."""
    return {key: getattr(ns, key) for key in OVERRIDES}


def check_train_view_size(owner: str, record: Mapping[str, Any] | None, datamodule: Any) -> None:
    """Warn (global rank 0) when the data module's training views (``LinearEval``'s
    ``LinearEvalTransform``) are not of the checkpoint's recorded crop size."""
    transform = getattr(datamodule, "train_transform", None)
    if record is None or transform is None:
        return
    crop = int(record["crop_size"])
    size = train_view_size(transform, getattr(datamodule.device_transform, "crop_size", None))
    if tuple(size) != (crop, crop):
        rank_zero_warn(
            f"{owner} trains on {size[0]}x{size[1]} px views, but the checkpoint's backbone was "
            f"fed {crop} px crops: set --data.train_transform.init_args.crop_size {crop}.",
            category=PreprocessingWarning)


def adopt_dense_normalisation(owner: str, record: Mapping[str, Any] | None,
                              datamodule: Any, source: str) -> None:
    """For a dense probe (``SegLinearProbe``, ``DepthLinearProbe``, ``DenseKNNSegmentation``):
    normalise the dense data module's images by the checkpoint's recorded mean and std unless
    ``--data.mean`` / ``--data.std`` were given (then warn where they differ from the record),
    warn when the backbone was fed other than RGB images, and print one line of what is used
    (global rank 0). The crop and resize sizes stay the protocol's (the line says so)."""
    if not callable(getattr(datamodule, "normalise_with", None)):
        return  # not a dense data module: nothing to adopt
    if record is None:
        rank_zero_warn(f"{source} does not record how its backbone was fed, so {owner} "
                       "normalises by the data module's mean and std (ImageNet's unless "
                       "--data.mean / --data.std are given), a guess.",
                       category=PreprocessingWarning)
        origin = "the data module's (the checkpoint has no record)"
    elif record.get("image_reader") != "rgb" or int(record.get("channels", 3)) != 3:
        rank_zero_warn(f"{owner}: the backbone was fed {describe(record)} ({source}), but the "
                       "dense data modules read RGB images: the probe's inputs are not the "
                       "backbone's.", category=PreprocessingWarning)
        origin = "the data module's (the checkpoint's are not of RGB images)"
    elif not datamodule.normalisation_given:
        datamodule.normalise_with(record["mean"], record["std"])
        origin = "the checkpoint's"
    else:
        origin = "--data.mean / --data.std"
        mean, std = datamodule.normalisation
        changed = [key for key, value in (("mean", mean), ("std", std))
                   if differs(value, record.get(key))]
        if changed:
            rank_zero_warn(
                f"{owner}: --data.{' and --data.'.join(changed)} override the checkpoint's: the "
                f"backbone was trained on mean {record['mean']}, std {record['std']} ({source}). "
                "Leave them unset to use the checkpoint's.", category=PreprocessingWarning)
    mean, std = datamodule.normalisation
    rank_zero_only(print)(
        f"{owner}: normalisation from {origin}: mean {[round(m, 4) for m in mean]}, std "
        f"{[round(v, 4) for v in std]}, rgb images; crop {datamodule.crop_size} px and val "
        f"shorter side {datamodule.eval_size} px are the protocol's (--data.crop_size, "
        "--data.eval_size), not the checkpoint's.")
