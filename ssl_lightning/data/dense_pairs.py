"""Data modules of (image, target) pairs for dense probes: segmentation masks and depth maps.

Training samples get one random scale, crop and flip each, drawn from the sample's seed
(:class:`~ssl_lightning.data.seeding.SeededDataset`) and applied to the image and its target
alike. Batches: training ``(images (B, 3, S, S), targets (B, S, S), sample_seeds)``;
validation ``[bank, queries]`` (``bank`` only when ``bank_images`` is not 0): ``bank`` holds
training images resized and centre-cropped to ``crop_size`` (the dense kNN's memory bank),
``queries`` the val images resized to ``eval_size`` on their shorter side with their targets
at full resolution (``eval_batch_size`` 1, since sizes differ). Targets are int64 label maps
(:data:`~ssl_lightning.data.dense_layouts.IGNORE_INDEX` ignored) or float32 depths in metres
(0 = no depth). The folder layouts are those of :mod:`ssl_lightning.data.dense_layouts`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from ssl_lightning._lightning import pl
from ssl_lightning.data.dense_layouts import (
    IGNORE_INDEX,
    DepthLayout,
    SegLayout,
    check_sizes,
    depth_pairs,
    read_depth,
    read_mask,
    read_rgb,
    segmentation_pairs,
)
from ssl_lightning.data.seeding import EpochSampler, SeededDataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def resize_pair(image: Tensor, target: Tensor, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Image (3, H, W) bilinearly and target (H, W) by nearest neighbour to ``size``."""
    image = F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0]
    resized = F.interpolate(target[None, None].float(), size=size, mode="nearest")[0, 0]
    return image, resized.to(target.dtype)


def short_side_size(height: int, width: int, short: float) -> tuple[int, int]:
    """``(H, W)`` scaled so that the shorter side is ``short`` (rounded)."""
    factor = short / min(height, width)
    return max(1, round(height * factor)), max(1, round(width * factor))


class DensePairTransform:
    """One sample's random scale, crop and flip, the same for the image and its target.

    The shorter side is resized to ``resize_size`` × s (s uniform in ``scale_range``; mmseg's
    ``RandomResize`` ratio range as DINOv2's segmentation probes use it), a ``crop_size`` square
    is cut at a uniform position (padded with 0 / ``fill`` where the image is smaller), and both
    are flipped left-right with probability 1/2; the image is then normalised. Every draw comes
    from the global torch RNG, which :class:`SeededDataset` seeds per sample.
    """

    def __init__(self, crop_size: int, resize_size: int, scale_range: Sequence[float],
                 flip: bool, mean: Sequence[float], std: Sequence[float], fill: float) -> None:
        low, high = scale_range
        if not 0 < low <= high:
            raise ValueError(f"scale_range must be (low, high) with 0 < low <= high, got "
                             f"{tuple(scale_range)}.")
        self.crop_size, self.resize_size, self.scale_range = crop_size, resize_size, (low, high)
        self.flip, self.fill = flip, fill
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def __call__(self, image: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        low, high = self.scale_range
        scale = low + (high - low) * float(torch.rand(()))
        height, width = image.shape[-2:]
        image, target = resize_pair(image, target, short_side_size(
            height, width, self.resize_size * scale))
        crop = self.crop_size
        pad_h, pad_w = max(crop - image.shape[1], 0), max(crop - image.shape[2], 0)
        if pad_h or pad_w:
            image = F.pad(image, (0, pad_w, 0, pad_h))
            target = F.pad(target, (0, pad_w, 0, pad_h), value=self.fill)
        top = int(torch.randint(image.shape[1] - crop + 1, ()))
        left = int(torch.randint(image.shape[2] - crop + 1, ()))
        image = image[:, top:top + crop, left:left + crop]
        target = target[top:top + crop, left:left + crop]
        if self.flip and float(torch.rand(())) < 0.5:
            image, target = image.flip(-1), target.flip(-1)
        return (image - self.mean) / self.std, target.contiguous()


class DenseEvalTransform:
    """Deterministic: the shorter side resized to ``size`` (None keeps it), the target left at
    full resolution; with ``center_crop`` both are resized and centre-cropped to a ``size``
    square (the kNN bank's fixed-size batches)."""

    def __init__(self, size: int | None, mean: Sequence[float], std: Sequence[float],
                 center_crop: bool = False) -> None:
        if center_crop and size is None:
            raise ValueError("center_crop needs a size.")
        self.size, self.center_crop = size, center_crop
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def __call__(self, image: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if self.size is not None:
            resized = short_side_size(image.shape[-2], image.shape[-1], self.size)
            if self.center_crop:
                image, target = resize_pair(image, target, resized)
                top, left = (resized[0] - self.size) // 2, (resized[1] - self.size) // 2
                image = image[:, top:top + self.size, left:left + self.size]
                target = target[top:top + self.size, left:left + self.size].contiguous()
            else:
                image = F.interpolate(image[None], size=resized, mode="bilinear",
                                      align_corners=False)[0]
        return (image - self.mean) / self.std, target


class DensePairs(Dataset):
    """``(image, target)`` of file pairs, read by ``read_target`` and transformed together."""

    def __init__(self, pairs: list[tuple[Path, Path]], read_target: Callable[[Path], Tensor],
                 transform: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> None:
        self.pairs, self.read_target, self.transform = pairs, read_target, transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image_path, target_path = self.pairs[index]
        image, target = read_rgb(image_path), self.read_target(target_path)
        if image.shape[-2:] != target.shape:
            raise ValueError(f"{image_path} is {tuple(image.shape[-2:])} but its target "
                             f"{target_path} is {tuple(target.shape)}.")
        return self.transform(image, target)


class DenseDataModule(pl.LightningDataModule):
    """Pairs of images and dense targets from a folder layout (the subclasses say which).

    Args:
        root: The dataset folder.
        train_split / val_split: Split names (None: the layout's usual ones).
        batch_size: Training batch size per device.
        eval_batch_size: Batch size of the val loaders (1 unless every val image has one size).
        num_workers: Loader worker processes.
        crop_size: Side of the square training crops (and of the kNN bank's images).
        resize_size: Shorter side before the random scale (None: ``crop_size``).
        scale_range: Range of the random scale of training images.
        flip: Random left-right flips in training.
        eval_size: Shorter side of the val images (None: as stored); predictions are scored at
            the target's full resolution.
        bank_images: Training images in the kNN bank loader (None: all, a fixed random subset
            otherwise, 0: no bank loader).
        mean / std: Normalisation of the images; None: the probe's checkpoint's recorded
            statistics when it has them (the probes adopt them at setup), else ImageNet's.
        seed: Seed of the training order and crops (None: ``seed_everything``'s, else 0).
        check: Before training, read every pair and refuse bad ones (size mismatch, labels out
            of range) with an error naming the file; headers only when False.
    """

    layout_splits: dict[str, tuple[str, str]] = {}
    fill: float = 0.0

    def __init__(self, root: str, layout: str, train_split: str | None = None,
                 val_split: str | None = None, batch_size: int = 16, eval_batch_size: int = 1,
                 num_workers: int = 4, crop_size: int = 512, resize_size: int | None = None,
                 scale_range: tuple[float, float] = (0.5, 2.0), flip: bool = True,
                 eval_size: int | None = 512, bank_images: int | None = None,
                 mean: tuple[float, float, float] | None = None,
                 std: tuple[float, float, float] | None = None, seed: int | None = None,
                 check: bool = True) -> None:
        super().__init__()
        if layout not in self.layout_splits:
            raise ValueError(f"layout must be one of {', '.join(self.layout_splits)}; got "
                             f"{layout!r}.")
        for name, value in [("batch_size", batch_size), ("eval_batch_size", eval_batch_size),
                            ("crop_size", crop_size)]:
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
        self.root, self.layout = root, layout
        self.train_split = train_split or self.layout_splits[layout][0]
        self.val_split = val_split or self.layout_splits[layout][1]
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_workers, self.crop_size, self.bank_images = num_workers, crop_size, bank_images
        self.seed, self.check = seed, check
        self.eval_size = eval_size
        #: Whether ``mean`` or ``std`` was given (else a probe may adopt its checkpoint's).
        self.normalisation_given = mean is not None or std is not None
        mean, std = mean or IMAGENET_MEAN, std or IMAGENET_STD
        self.train_transform = DensePairTransform(crop_size, resize_size or crop_size,
                                                  scale_range, flip, mean, std, self.fill)
        self.eval_transform = DenseEvalTransform(eval_size, mean, std)
        self.bank_transform = DenseEvalTransform(crop_size, mean, std, center_crop=True)
        self.train_pairs: list[tuple[Path, Path]] | None = None
        self.val_pairs: list[tuple[Path, Path]] | None = None

    @property
    def normalisation(self) -> tuple[list[float], list[float]]:
        """The per-channel mean and std every loader normalises the images with."""
        transform = self.eval_transform
        return transform.mean.flatten().tolist(), transform.std.flatten().tolist()

    def normalise_with(self, mean: Sequence[float], std: Sequence[float]) -> None:
        """Normalise the images of every loader (training, bank, queries) by ``mean`` and
        ``std`` (a probe's checkpoint's statistics); before the loaders are built."""
        for transform in (self.train_transform, self.eval_transform, self.bank_transform):
            transform.mean = torch.tensor(mean)[:, None, None]
            transform.std = torch.tensor(std)[:, None, None]

    def find_pairs(self, split: str) -> list[tuple[Path, Path]]:
        """The ``(image, target)`` files of ``split``."""
        raise NotImplementedError

    def read_target(self, path: Path) -> Tensor:
        """The target map of a file (raising ValueError naming it when bad)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Find the pairs of both splits and refuse bad ones before any step."""
        if self.train_pairs is not None:
            return
        train, val = self.find_pairs(self.train_split), self.find_pairs(self.val_split)
        for pairs in (train, val):
            check_sizes(pairs)
            if self.check:
                for _, target in pairs:
                    self.read_target(target)
        self.train_pairs, self.val_pairs = train, val

    @property
    def train_seed(self) -> int:
        """Seed of the training order and crops (see the ``seed`` argument)."""
        return self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        dataset = DensePairs(self.train_pairs or [], self.read_target, self.train_transform)
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = EpochSampler(dataset, self.batch_size, True, num_replicas=world, rank=rank,
                               seed=self.train_seed)
        return StatefulDataLoader(SeededDataset(dataset, self.train_seed),
                                  batch_size=self.batch_size, sampler=sampler, drop_last=True,
                                  num_workers=self.num_workers)

    def val_dataloader(self) -> list[DataLoader]:
        self.setup("validate")
        train, val = self.train_pairs or [], self.val_pairs or []
        loaders = []
        if self.bank_images != 0:
            bank: Dataset = DensePairs(train, self.read_target, self.bank_transform)
            if self.bank_images is not None and self.bank_images < len(train):
                order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
                bank = Subset(bank, order[:self.bank_images].sort().values.tolist())
            loaders.append(DataLoader(bank, batch_size=self.eval_batch_size,
                                      num_workers=self.num_workers))
        queries = DensePairs(val, self.read_target, self.eval_transform)
        loaders.append(DataLoader(queries, batch_size=self.eval_batch_size,
                                  num_workers=self.num_workers))
        return loaders


class SegmentationDataModule(DenseDataModule):
    """Images and class masks in the ADE20K, Pascal VOC, Cityscapes or ``folders`` layout
    (:mod:`ssl_lightning.data.dense_layouts`); the masks' ignored pixels are
    :data:`~ssl_lightning.data.dense_layouts.IGNORE_INDEX` in the batches.

    Args:
        num_classes: Number of classes (ADE20K 150, VOC 21, Cityscapes 19).
        layout: ``"ade20k"``, ``"voc"``, ``"cityscapes"`` or ``"folders"``.
        reduce_zero_label: Label 0 is ignored and k becomes k - 1 (None: True for ADE20K only).
        ignore_index: The value the mask files use for ignored pixels (255 in all four).
        **kwargs: The arguments of :class:`DenseDataModule`.
    """

    layout_splits = {"ade20k": ("training", "validation"), "voc": ("train", "val"),
                     "cityscapes": ("train", "val"), "folders": ("train", "val")}
    fill = float(IGNORE_INDEX)

    def __init__(self, root: str, num_classes: int, layout: SegLayout = "folders",
                 reduce_zero_label: bool | None = None, ignore_index: int = IGNORE_INDEX,
                 **kwargs: Any) -> None:
        super().__init__(root, layout, **kwargs)
        if not 2 <= num_classes <= IGNORE_INDEX:
            raise ValueError(f"num_classes must be in [2, {IGNORE_INDEX}], got {num_classes}.")
        self.num_classes = num_classes
        self.reduce_zero_label = layout == "ade20k" if reduce_zero_label is None \
            else reduce_zero_label
        self.ignore_index = ignore_index

    def find_pairs(self, split: str) -> list[tuple[Path, Path]]:
        return segmentation_pairs(self.root, self.layout, split)  # type: ignore[arg-type]

    def read_target(self, path: Path) -> Tensor:
        return read_mask(path, self.num_classes, self.reduce_zero_label, self.ignore_index)


class DepthDataModule(DenseDataModule):
    """Images and depth maps (metres; 0 = no depth) in the ``folders`` or NYUv2 layout
    (:mod:`ssl_lightning.data.dense_layouts`).

    Args:
        layout: ``"folders"`` (``images/`` + ``depths/``) or ``"nyu"``.
        png_depth_scale: Units per metre of 16-bit PNG depths (1000: millimetres).
        **kwargs: The arguments of :class:`DenseDataModule` (NYUv2's probes use 480×640
            images: ``eval_size: 480``).
    """

    layout_splits = {"folders": ("train", "val"), "nyu": ("train", "test")}

    def __init__(self, root: str, layout: DepthLayout = "folders",
                 png_depth_scale: float = 1000.0, **kwargs: Any) -> None:
        super().__init__(root, layout, **kwargs)
        if png_depth_scale <= 0:
            raise ValueError(f"png_depth_scale must be > 0, got {png_depth_scale}.")
        self.png_depth_scale = png_depth_scale

    def find_pairs(self, split: str) -> list[tuple[Path, Path]]:
        return depth_pairs(self.root, self.layout, split)  # type: ignore[arg-type]

    def read_target(self, path: Path) -> Tensor:
        return read_depth(path, self.png_depth_scale)
