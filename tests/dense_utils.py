"""Synthetic dense-prediction data whose masks and depths are known by construction.

``make_segmentation_folder(root, ...)`` writes ``root/{train,val}/images/N.png`` and
``masks/N.png``: a background of class 0's colour with squares of the other classes' colours on
an 8-pixel grid, so the class of a pixel is its colour. ``make_depth_folder`` writes the same
images with ``depths/N.png`` (16-bit, millimetres): the depth of a pixel is a function of its
colour (:data:`DEPTHS` metres per class).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

#: The colour of each class.
COLOURS = np.array([[20, 20, 20], [230, 40, 40], [40, 220, 60], [50, 60, 230]], dtype=np.uint8)
#: The depth in metres of each class' colour.
DEPTHS = np.array([2.0, 2.5, 3.0, 3.5])


def label_map(rng: np.random.Generator, size: int, classes: int, cell: int = 8) -> np.ndarray:
    """A (size, size) uint8 label map: class 0 with two random squares of other classes."""
    labels = np.zeros((size, size), dtype=np.uint8)
    cells = size // cell
    for _ in range(2):
        side = int(rng.integers(1, cells // 2 + 1))
        top, left = rng.integers(0, cells - side + 1, size=2)
        labels[top * cell:(top + side) * cell, left * cell:(left + side) * cell] = \
            rng.integers(1, classes)
    return labels


def _write_split(root: Path, split: str, count: int, size: int, classes: int, seed: int,
                 target: str) -> None:
    rng = np.random.default_rng(seed)
    (root / split / "images").mkdir(parents=True, exist_ok=True)
    (root / split / target).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        labels = label_map(rng, size, classes)
        Image.fromarray(COLOURS[labels]).save(root / split / "images" / f"{i}.png")
        if target == "masks":
            Image.fromarray(labels).save(root / split / "masks" / f"{i}.png")
        else:
            millimetres = (DEPTHS[labels] * 1000).astype(np.uint16)
            Image.fromarray(millimetres).save(root / split / "depths" / f"{i}.png")


def make_segmentation_folder(root: Path, classes: int = 3, train: int = 16, val: int = 4,
                             size: int = 32) -> Path:
    """The ``folders`` segmentation layout (see the module docstring)."""
    _write_split(root, "train", train, size, classes, 0, "masks")
    _write_split(root, "val", val, size, classes, 1, "masks")
    return root


def make_depth_folder(root: Path, train: int = 16, val: int = 4, size: int = 32) -> Path:
    """The ``folders`` depth layout (see the module docstring)."""
    _write_split(root, "train", train, size, 4, 0, "depths")
    _write_split(root, "val", val, size, 4, 1, "depths")
    return root
