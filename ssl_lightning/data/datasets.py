"""An ImageFolder-style dataset whose labels are optional, with clear errors for bad data.

Labeled layout: ``root/<class>/<image>`` (classes sorted by name, as torchvision's ImageFolder).
Unlabeled: every image under ``root`` (a flat folder, or class folders whose names are ignored),
with target -1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
UNLABELED = -1


#: PIL modes of more than 8 bits per pixel; ``convert("RGB")`` clips them at 255 (all white).
HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


class CorruptImageError(RuntimeError):
    """An image file exists but cannot be decoded (or its values cannot be scaled to 8 bit)."""


def load_image(path: str | Path) -> Image.Image:
    """Open ``path`` as an RGB PIL image, fully decoded.

    16-bit and float grayscale images (PIL modes ``I;16``, ``I``, ``F``) are scaled to 8 bit
    first (:func:`to_8bit`), since PIL's own conversion clips them to white.

    Raises:
        CorruptImageError: naming the file, when it cannot be read or decoded, or its values
            lie outside the range its mode allows.
    """
    try:
        with Image.open(path) as image:
            if image.mode in HIGH_DEPTH_MODES:
                return to_8bit(image).convert("RGB")
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise CorruptImageError(
            f"Cannot read image file {path}: {err}. Replace or delete this file."
        ) from err


def to_8bit(image: Image.Image) -> Image.Image:
    """Scale a 16-bit or float grayscale image to an 8-bit ``L`` image, the same rule for
    every file (never per-image min/max, which would change contrast between images).

    ``I;16*`` and ``I`` (integers, e.g. 16-bit PNG/TIFF): ``[0, 65535] -> [0, 255]``, i.e.
    ``round(x / 257)``; ``F`` (float): ``[0, 1] -> [0, 255]``.

    Raises:
        ValueError: the values lie outside that range (32-bit integer or unnormalised float
            data), naming the range found and what to do.
    """
    pixels = np.asarray(image)
    high, unit = (1.0, "float") if image.mode == "F" else (65535.0, "16-bit")
    low_found, high_found = float(np.min(pixels)), float(np.max(pixels))
    if not (0.0 <= low_found and high_found <= high):  # also catches NaN
        raise ValueError(
            f"its mode {image.mode!r} values lie in [{low_found:g}, {high_found:g}], outside "
            f"the [0, {high:g}] range read as {unit} data; convert the file to 8-bit RGB "
            "yourself (choosing the scaling)"
        )
    scaled = np.rint(pixels.astype(np.float64) * (255.0 / high)).astype(np.uint8)
    return Image.fromarray(scaled)  # mode L


def check_directory(path: str | Path, hint: str = "") -> Path:
    """Return ``path`` as a Path if it is an existing directory.

    Raises:
        FileNotFoundError: naming the expected path, followed by ``hint`` (how to get the data).
    """
    path = Path(path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"Data directory {path} {what}. {hint}".strip())
    return path


def find_images(root: Path) -> list[str]:
    """All image files under ``root`` (recursive, hidden entries skipped), sorted."""
    found = []
    for directory, subdirs, files in os.walk(root, followlinks=True):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        found += [os.path.join(directory, f) for f in files
                  if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(found)


def has_class_folders(root: str | Path) -> bool:
    """True if ``root`` holds sub-folders and no loose images (the labeled layout)."""
    root = Path(root)
    entries = [e for e in root.iterdir() if not e.name.startswith(".")]
    subdirs = any(e.is_dir() for e in entries)
    loose = any(e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS) for e in entries)
    return subdirs and not loose


class ImageFolderDataset(Dataset):
    """Images under a folder, labeled by class sub-folder or unlabeled.

    Args:
        root: The folder.
        labeled: ``True``: ``root/<class>/<image>`` with targets = class index (sorted names);
            ``False``: every image under ``root`` with target -1; ``None``: labeled when ``root``
            holds only sub-folders (no loose images).
        transform: Applied to the PIL image (e.g. a :class:`MultiViewTransform`).
        hint: Appended to the missing/empty-directory errors (how to get the data).

    Raises:
        FileNotFoundError: ``root`` is missing or holds no images.
    """

    def __init__(
        self,
        root: str | Path,
        labeled: bool | None = None,
        transform: Callable[[Image.Image], Any] | None = None,
        hint: str = "",
    ) -> None:
        self.root = check_directory(root, hint)
        self.labeled = has_class_folders(self.root) if labeled is None else labeled
        self.transform = transform
        if self.labeled:
            self.classes = sorted(d.name for d in self.root.iterdir()
                                  if d.is_dir() and not d.name.startswith("."))
            self.samples = [(path, index) for index, name in enumerate(self.classes)
                            for path in find_images(self.root / name)]
        else:
            self.classes = []
            self.samples = [(path, UNLABELED) for path in find_images(self.root)]
        if not self.samples:
            layout = f"{self.root}/<class>/<image>" if self.labeled else f"{self.root}/<image>"
            raise FileNotFoundError(
                f"No images ({', '.join(IMAGE_EXTENSIONS)}) found in {self.root}; expected the "
                f"layout {layout}. {hint}".strip()
            )

    @property
    def targets(self) -> list[int]:
        """The target of every sample (-1 when unlabeled)."""
        return [target for _, target in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, target = self.samples[index]
        image = load_image(path)
        return (self.transform(image) if self.transform is not None else image), target

    def __repr__(self) -> str:
        kind = f"{len(self.classes)} classes" if self.labeled else "unlabeled"
        return f"{type(self).__name__}({self.root}, {len(self)} images, {kind})"
