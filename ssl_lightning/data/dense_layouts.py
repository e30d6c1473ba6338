"""Where the (image, target) pairs of a dense-prediction dataset are, and how a target file reads.

Segmentation layouts (``root`` is the dataset folder, ``split`` e.g. ``"training"``/``"train"``):

- ``"ade20k"``: ``images/<split>/X.jpg`` with ``annotations/<split>/X.png``; label 0 means
  "other" and is ignored, 1..150 are the classes (``reduce_zero_label``: 0 → ignore, k → k-1).
- ``"voc"``: ``ImageSets/Segmentation/<split>.txt`` lists ids; ``JPEGImages/<id>.jpg`` with
  ``SegmentationClass/<id>.png`` (palette PNGs: the pixel values are the palette indices,
  0..20 the classes, 255 the object borders, ignored).
- ``"cityscapes"``: ``leftImg8bit/<split>/<city>/X_leftImg8bit.png`` with
  ``gtFine/<split>/<city>/X_gtFine_labelTrainIds.png`` (19 classes, 255 ignored).
- ``"folders"``: a user's own data, ``<split>/images/X.<ext>`` with ``<split>/masks/X.png``
  (class ids as pixel values; ``ignore_index`` ignored).

Depth layouts: ``"folders"``: ``<split>/images/X.<ext>`` with ``<split>/depths/X.png`` or
``X.npy``; ``"nyu"``: NYUv2's ``<split>/<scene>/rgb_N.jpg`` with ``sync_depth_N.png`` beside it.
A 16-bit PNG holds millimetres (``png_depth_scale`` 1000), a ``.npy`` metres; 0 is "no depth".
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ssl_lightning.data.indexing import IMAGE_EXTENSIONS

SegLayout = Literal["ade20k", "voc", "cityscapes", "folders"]
DepthLayout = Literal["folders", "nyu"]

#: The value of a ``(H, W)`` label map that no class has (ADE20K's 0, VOC's borders, ...).
IGNORE_INDEX = 255


def _need_dir(path: Path, layout: str) -> Path:
    if not path.is_dir():
        raise ValueError(f"The {layout} layout needs the folder {path}, which does not exist "
                         "(check --data.root, --data.layout and the split names).")
    return path


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)


def _paired(images: list[Path], target_of: dict[Path, Path], layout: str) -> list[tuple[Path,
                                                                                        Path]]:
    """``(image, target)`` pairs; a missing target file is an error naming both."""
    if not images:
        raise ValueError(f"The {layout} layout found no images; check --data.root.")
    missing = [(i, target_of[i]) for i in images if not target_of[i].is_file()]
    if missing:
        image, target = missing[0]
        raise ValueError(f"{len(missing)} image(s) of the {layout} layout have no target file, "
                         f"e.g. {image} has no {target}. Add the file or remove the image.")
    return [(i, target_of[i]) for i in images]


def segmentation_pairs(root: str | Path, layout: SegLayout, split: str) -> list[tuple[Path, Path]]:
    """The sorted ``(image, mask)`` file pairs of ``split`` (see the module docstring)."""
    root = Path(root)
    if layout == "ade20k":
        images = _images(_need_dir(root / "images" / split, layout))
        masks = _need_dir(root / "annotations" / split, layout)
        target_of = {i: masks / i.relative_to(root / "images" / split).with_suffix(".png")
                     for i in images}
    elif layout == "voc":
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise ValueError(f"The voc layout needs {listing}, which does not exist.")
        ids = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
        bad = [i for i in ids if Path(i).name != i]
        if bad:
            raise ValueError(f"{listing} names {bad[0]!r}, not a plain file id.")
        images = [root / "JPEGImages" / f"{i}.jpg" for i in ids]
        absent = [i for i in images if not i.is_file()]
        if absent:
            raise ValueError(f"{listing} lists {len(absent)} image(s) that do not exist, e.g. "
                             f"{absent[0]}.")
        target_of = {i: root / "SegmentationClass" / f"{i.stem}.png" for i in images}
    elif layout == "cityscapes":
        base = _need_dir(root / "leftImg8bit" / split, layout)
        images = sorted(base.rglob("*_leftImg8bit.png"))
        target_of = {i: root / "gtFine" / split / i.parent.name / i.name.replace(
            "_leftImg8bit.png", "_gtFine_labelTrainIds.png") for i in images}
    elif layout == "folders":
        images = _images(_need_dir(root / split / "images", layout))
        target_of = {i: root / split / "masks" / i.relative_to(root / split / "images")
                     .with_suffix(".png") for i in images}
    else:
        raise ValueError(f"layout must be one of ade20k, voc, cityscapes, folders; got {layout!r}.")
    return _paired(images, target_of, layout)


def depth_pairs(root: str | Path, layout: DepthLayout, split: str) -> list[tuple[Path, Path]]:
    """The sorted ``(image, depth)`` file pairs of ``split`` (see the module docstring)."""
    root = Path(root)
    if layout == "folders":
        base = root / split / "images"
        images = _images(_need_dir(base, layout))
        depths = root / split / "depths"
        target_of = {}
        for i in images:
            stem = depths / i.relative_to(base).with_suffix("")
            npy = stem.with_suffix(".npy")
            target_of[i] = npy if npy.is_file() else stem.with_suffix(".png")
    elif layout == "nyu":
        images = sorted(_need_dir(root / split, layout).rglob("rgb_*.jpg"))
        target_of = {i: i.with_name(i.name.replace("rgb_", "sync_depth_")).with_suffix(".png")
                     for i in images}
    else:
        raise ValueError(f"layout must be folders or nyu; got {layout!r}.")
    return _paired(images, target_of, layout)


def read_mask(path: Path, num_classes: int, reduce_zero_label: bool = False,
              ignore_index: int = IGNORE_INDEX) -> Tensor:
    """A label map ``(H, W)`` int64 with classes ``0..num_classes-1`` and :data:`IGNORE_INDEX`.

    A palette PNG reads as its indices (VOC), never as colours. ``reduce_zero_label`` maps 0 to
    ignored and k to k - 1 (ADE20K); the file's ``ignore_index`` becomes :data:`IGNORE_INDEX`.

    Raises:
        ValueError: the file is not a single-channel label map, or holds a value that is
            neither a class nor ignored (naming the file, the value and the classes).
    """
    with Image.open(path) as image:
        if image.mode not in ("P", "L", "I", "I;16"):
            raise ValueError(f"{path} is a {image.mode} image, not a label map (one channel of "
                             "class ids, or a palette PNG).")
        labels = torch.from_numpy(np.array(image).astype(np.int64))
    ignored = labels == ignore_index
    if reduce_zero_label:
        ignored |= labels == 0
        labels = labels - 1
    bad = ~ignored & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        value = int(labels[bad][0]) + int(reduce_zero_label)
        classes = f"1..{num_classes}" if reduce_zero_label else f"0..{num_classes - 1}"
        raise ValueError(f"{path} holds the label {value}, outside the {num_classes} classes "
                         f"({classes}, {ignore_index} ignored). Check --data.num_classes, "
                         "--data.layout and reduce_zero_label.")
    return labels.masked_fill(ignored, IGNORE_INDEX)


def read_depth(path: Path, png_depth_scale: float = 1000.0) -> Tensor:
    """A depth map ``(H, W)`` float32 in metres (0 = no depth): a ``.npy`` in metres or a
    16-bit PNG of ``png_depth_scale`` units per metre (millimetres by default).

    Raises:
        ValueError: the file is not one 2-D map, or holds negative or non-finite depths.
    """
    if path.suffix.lower() == ".npy":
        depth = torch.from_numpy(np.load(path, allow_pickle=False).astype(np.float32))
    else:
        with Image.open(path) as image:
            if image.mode not in ("I", "I;16", "L"):
                raise ValueError(f"{path} is a {image.mode} image, not a depth map (a 16-bit "
                                 "grayscale PNG).")
            depth = torch.from_numpy(np.array(image).astype(np.float32)) / png_depth_scale
    if depth.dim() != 2:
        raise ValueError(f"{path} holds an array of shape {tuple(depth.shape)}, not a (H, W) "
                         "depth map.")
    if not torch.isfinite(depth).all() or (depth < 0).any():
        raise ValueError(f"{path} holds negative or non-finite depths; 0 marks a pixel without "
                         "depth.")
    return depth


def read_rgb(path: Path) -> Tensor:
    """An image as a float32 ``(3, H, W)`` tensor in [0, 1]."""
    with Image.open(path) as image:
        array = np.array(image.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1).float() / 255


def image_size(path: Path) -> tuple[int, int]:
    """``(H, W)`` of an image file from its header, or of a ``.npy`` array."""
    if path.suffix.lower() == ".npy":
        shape = np.load(path, mmap_mode="r", allow_pickle=False).shape
        return int(shape[0]), int(shape[1])
    with Image.open(path) as image:
        width, height = image.size
    return height, width


def check_sizes(pairs: list[tuple[Path, Path]]) -> None:
    """Refuse a pair whose image and target differ in size (naming both files)."""
    for image, target in pairs:
        if image_size(image) != image_size(target):
            raise ValueError(f"{image} is {image_size(image)} (H, W) but its target {target} is "
                             f"{image_size(target)}; an image and its target must have the same "
                             "size.")
