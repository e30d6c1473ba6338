"""Sanity checks of the evaluation data, and the fixed class-balanced order of its loaders.

Silent data mistakes make the kNN / probe numbers meaningless without any error: a CIFAR-10
module reading CIFAR-100 folders, train and val splits with different class folders (class
indices are positions in the sorted folder list, so every label after a missing class shifts
between the kNN bank and the queries), a single class (every prediction is right: 100 %), or
``limit_val_batches`` on class-sorted data (the first batches hold one class: 100 % again).
:func:`check_eval_classes` turns the first three into clear errors or warnings before
training; :func:`balanced_order` gives the evaluation loaders an order whose every prefix
holds all classes in proportion.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from ssl_lightning._lightning import rank_zero_warn


def _base(dataset: Dataset) -> Dataset:
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset


def dataset_targets(dataset: Dataset) -> list[int] | None:
    """The label of every sample, read without decoding images (``targets`` of an
    ImageFolder / torchvision dataset, through any ``Subset``); None when unknown."""
    if isinstance(dataset, Subset):
        inner = dataset_targets(dataset.dataset)
        return None if inner is None else [inner[i] for i in dataset.indices]
    targets = getattr(dataset, "targets", None)
    if targets is None or len(targets) != len(dataset):  # type: ignore[arg-type]
        return None
    return [int(t) for t in targets]


def dataset_classes(dataset: Dataset) -> list[str] | None:
    """The class names of a labeled dataset (its sorted class folders); None when unknown."""
    classes = getattr(_base(dataset), "classes", None)
    return list(classes) if classes else None


def _where(dataset: Dataset) -> str:
    return str(getattr(_base(dataset), "root", type(_base(dataset)).__name__))


def check_eval_classes(bank: Dataset, queries: Dataset, num_classes: int | None,
                       module: str) -> None:
    """Refuse evaluation splits whose labels cannot be compared, warn about a class-count gap.

    Args:
        bank: The kNN bank / probe reference split (train).
        queries: The query split (val).
        num_classes: The data module's declared class count, or None.
        module: The data module's name, for the messages.

    Raises:
        ValueError: the two splits have different class lists; there are more classes than
            ``num_classes``; or fewer than 2 classes.
    """
    bank_classes, query_classes = dataset_classes(bank), dataset_classes(queries)
    if bank_classes is not None and query_classes is not None and bank_classes != query_classes:
        only_bank = sorted(set(bank_classes) - set(query_classes))
        only_queries = sorted(set(query_classes) - set(bank_classes))
        raise ValueError(
            f"The train split {_where(bank)} has {len(bank_classes)} classes and the val split "
            f"{_where(queries)} has {len(query_classes)}: missing from val {only_bank}, missing "
            f"from train {only_queries}. Labels are positions in the sorted class-folder list, "
            "so they would shift between the kNN bank and the queries. Give both splits the "
            "same class folders (an empty folder keeps the positions aligned)."
        )
    classes = bank_classes or query_classes
    targets = dataset_targets(bank)
    count = len(classes) if classes is not None else (
        len(set(targets)) if targets is not None else None)
    if count is None:
        return
    if count < 2:
        raise ValueError(
            f"The evaluation data {_where(bank)} has a single class {classes or ''}: kNN and "
            "probe would report 100 %. Evaluate on data with >= 2 class folders, or pre-train "
            "without a labeled val split."
        )
    if num_classes is None or count == num_classes:
        return
    found = f"{_where(bank)} holds {count} classes but {module} expects {num_classes}"
    if count > num_classes:
        raise ValueError(
            f"{found}: labels >= {num_classes} would break the probe and the kNN. Use the data "
            "module of this dataset (e.g. CIFAR100DataModule for 100 classes) or "
            "ImageFolderDataModule."
        )
    rank_zero_warn(
        f"{found}: is this another dataset (CIFAR-10 data under a CIFAR-100 module)? Use the "
        f"matching data module; continuing with {count} of {num_classes} classes."
    )


def balanced_order(dataset: Dataset, seed: int = 0) -> list[int]:
    """A fixed order of ``dataset``'s indices in which every prefix holds each class in
    proportion to its size (a stratified interleave, random within a class).

    With it, ``limit_val_batches`` (and ``DistributedSampler``'s interleaved shards) sees every
    class instead of the first class of a class-sorted dataset. Unlabeled or unknown targets
    give a seeded random permutation. The same ``seed`` gives the same order on every run.
    """
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(len(dataset), generator=generator).tolist()  # type: ignore[arg-type]
    targets = dataset_targets(dataset)
    if targets is None:
        return permutation
    members: dict[int, list[int]] = {}
    for index in permutation:
        members.setdefault(targets[index], []).append(index)
    phases = torch.rand(len(members), generator=generator).tolist()
    keyed = [((k + phase) / len(indices), index)
             for (_, indices), phase in zip(sorted(members.items()), phases, strict=True)
             for k, index in enumerate(indices)]
    return [index for _, index in sorted(keyed)]


def _view_size(transform: Callable[[Any], Any], image: Image.Image) -> tuple[int, ...]:
    out = transform(image)
    first = out[0] if isinstance(out, (list, tuple)) else out
    return tuple(first.shape[-2:])


def _grey_image(transform: Callable[[Any], Any]) -> Any:
    """A grey 256 px input of the kind ``transform`` reads: its ``probe_input()`` when it has one
    (the multi-channel views read tensors), else an RGB PIL image."""
    make = getattr(transform, "probe_input", None)
    return make() if callable(make) else Image.new("RGB", (256, 256), (128, 128, 128))


def train_view_size(train_transform: Callable[[Any], Any],
                    device_crop: int | None = None) -> tuple[int, ...]:
    """(height, width) of the first (global) training view: ``device_crop`` (the crop of a
    ``DeviceViews``, whose train transform only decodes), else ``train_transform`` applied to a
    grey 256 px image, with the random state restored afterwards."""
    if device_crop:
        return device_crop, device_crop
    with torch.random.fork_rng(devices=[]):
        return _view_size(train_transform, _grey_image(train_transform))


def check_view_sizes(train_transform: Callable[[Any], Any], eval_transform: Callable[[Any], Any],
                     device_crop: int | None = None) -> None:
    """Warn when the (first, global) training view and the evaluation image differ in size.

    The evaluation transform is applied once to a grey 256 px image, with the random state
    restored afterwards; the training view size is :func:`train_view_size`.
    """
    train = train_view_size(train_transform, device_crop)
    with torch.random.fork_rng(devices=[]):
        evaluation = _view_size(eval_transform, _grey_image(eval_transform))
    if train != evaluation:
        rank_zero_warn(
            f"Training views are {train[0]}x{train[1]} px but the evaluation transform gives "
            f"{evaluation[0]}x{evaluation[1]} px: kNN / probe then measure features of another "
            "resolution than the one trained on (e.g. a 'cifar' train transform with the "
            "'imagenet' eval preset). Give both the same preset / crop_size."
        )


#: Files whose header :func:`check_image_sizes` reads.
SIZE_SAMPLE = 64


def image_short_sides(paths: Sequence[str | Path]) -> list[int]:
    """The shorter side of up to :data:`SIZE_SAMPLE` images spread evenly over ``paths``, read
    from their headers (PIL, no decoding); unreadable files are left out."""
    step = max(1, len(paths) // SIZE_SAMPLE)
    sides = []
    for path in paths[::step][:SIZE_SAMPLE]:
        try:
            with Image.open(path) as image:
                sides.append(min(image.size))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            continue  # reported when the file is loaded
    return sides


def check_image_sizes(dataset: Dataset, view_size: tuple[int, ...]) -> None:
    """Warn when the images are far larger (median shorter side > 4x) or far smaller (< 0.5x)
    than the training views, which suggests the preset of other images.

    Reads the headers (PIL, no decoding) of up to :data:`SIZE_SAMPLE` files spread evenly over
    a dataset with ``samples`` (an :class:`~ssl_lightning.data.ImageFolderDataset`); other
    datasets are not checked.
    """
    samples = getattr(_base(dataset), "samples", None)
    if not samples:
        return
    sides = image_short_sides([path for path, _ in samples])
    if not sides:
        return
    median, crop = statistics.median(sides), min(view_size)
    found = (f"The training images under {_where(dataset)} have a median shorter side of "
             f"{median:g} px ({len(sides)} files read), but the training views are {crop} px")
    if median > 4 * crop:
        rank_zero_warn(
            f"{found}: each view shows a small part of a much larger picture, or (the 'cifar' "
            "preset) a picture shrunk to the crop size. For photos use preset: imagenet, or set "
            "the crop_size of the train transform.")
    elif median < crop / 2:
        rank_zero_warn(
            f"{found}: every view is an upsampled, blurred image. For small images use preset: "
            "cifar, or set the crop_size of the train transform.")
