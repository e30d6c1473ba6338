"""An ImageFolder-style dataset whose labels are optional, with clear errors for bad data.

Labeled layout: ``root/<class>/<image>`` (classes sorted by name, as torchvision's ImageFolder).
Unlabeled: every image under ``root`` (a flat folder, or class folders whose names are ignored),
with target -1. The file lists come from :mod:`ssl_lightning.data.indexing` (fast, cached).
Symbolic links are followed, each real directory and each real file once (a link back to a
parent folder adds nothing). An image that cannot be decoded either stops the run or is
replaced by another image of the dataset (:class:`UnreadableImages`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ssl_lightning.data.indexing import (
    IMAGE_EXTENSIONS,
    has_loose_images,
    index_images,
    subfolders,
)
from ssl_lightning.data.seeding import active_sample_seed, mix64

UNLABELED = -1


#: PIL modes of more than 8 bits per pixel; ``convert("RGB")`` clips them at 255 (all white).
HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


OnError = Literal["skip", "raise"]
#: The list of the unreadable images a run skipped, in its log directory.
SKIPPED_IMAGES = "skipped_images.txt"


class CorruptImageError(RuntimeError):
    """An image file exists but cannot be decoded (or its values cannot be scaled to 8 bit).

    Its message is one line: re-raised from a DataLoader worker (whose message is the worker's
    whole traceback) it keeps only the original message.
    """

    def __init__(self, message: str) -> None:
        if message.startswith(f"Caught {type(self).__name__}"):
            last = message.rstrip().rsplit("\n", 1)[-1]
            message = last.split(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)


def load_image(path: str | Path | BinaryIO) -> Image.Image:
    """Open ``path`` (a file, or an open binary stream) as an RGB PIL image, fully decoded.

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


def class_folders(root: str | Path) -> list[str]:
    """The sorted names of ``root``'s sub-folders (hidden ones and links to ``root`` or a
    folder above it skipped): the classes of the labeled layout."""
    return [entry.name for entry in subfolders(root)]


def has_class_folders(root: str | Path) -> bool:
    """True if ``root`` holds sub-folders and no loose images (the labeled layout)."""
    return bool(subfolders(root)) and not has_loose_images(root)


@dataclass
class UnreadableImages:
    """What a dataset does with an image file that cannot be decoded.

    Attributes:
        on_error: ``"raise"``: stop with :class:`CorruptImageError` naming the file.
            ``"skip"``: warn once per file, append its path to ``record`` and return another
            image of the dataset in its place: the first readable one of a sequence of indices
            drawn from the sample's seed (see :mod:`ssl_lightning.data.seeding`; from its index
            outside a seeded loader), so the replacement is the same for any number of loader
            workers or processes, and on resume.
        max_fraction: With ``"skip"``, stop with :class:`CorruptImageError` once more than this
            fraction of the dataset's files are known to be unreadable (those found by this
            process and those listed in ``record`` by the others).
        record: File the unreadable paths are appended to, one per line (appends by any
            number of workers and processes are safe), or None.

    Raises:
        ValueError: an unknown ``on_error`` or a ``max_fraction`` outside [0, 1].
    """

    on_error: OnError = "raise"
    max_fraction: float = 0.01
    record: Path | None = None

    def __post_init__(self) -> None:
        if self.on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {self.on_error!r}.")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"max_corrupt_fraction must be in [0, 1], got {self.max_fraction}.")

    def listed(self) -> set[str]:
        """The paths in ``record`` (empty when there is none yet)."""
        if self.record is None or not self.record.is_file():
            return set()
        return set(self.record.read_text(encoding="utf-8").splitlines())

    def append(self, path: str) -> None:
        """Add ``path`` to ``record`` (one ``O_APPEND`` write, so concurrent lines never mix)."""
        if self.record is None:
            return
        self.record.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(handle, f"{path}\n".encode())
        finally:
            os.close(handle)


class ReplacingDataset(Dataset):
    """Samples read by ``loader``, an unreadable one handled by ``unreadable`` (raise, or skip:
    replaced by another sample drawn from the sample's seed, see :class:`UnreadableImages`).

    A subclass sets ``root`` (named in errors), ``samples`` (``(name, target)`` pairs, ``name``
    what ``loader`` reads), ``loader``, ``transform`` and ``unreadable``, then calls
    ``super().__init__()``.
    """

    root: str | Path  # a URL for shards read from object storage
    samples: list[tuple[str, int]]
    loader: Callable[[str], Any]
    transform: Callable[[Any], Any] | None
    unreadable: UnreadableImages

    def __init__(self) -> None:
        self._unreadable: set[int] = set()  # indices found unreadable by this process

    @property
    def targets(self) -> list[int]:
        """The target of every sample (-1 when unlabeled)."""
        return [target for _, target in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, target = self.samples[index]
        try:
            image = self.loader(path)
        except CorruptImageError as err:
            if self.unreadable.on_error == "raise":
                raise
            self._note_unreadable(index, err)
            index, image = self._replacement(index)
            target = self.samples[index][1]
        return (self.transform(image) if self.transform is not None else image), target

    @cached_property
    def _paths(self) -> set[str]:
        return {path for path, _ in self.samples}

    def _replacement(self, index: int) -> tuple[int, Any]:
        """The index and image standing in for the unreadable sample ``index``."""
        seed = active_sample_seed()
        generator = torch.Generator().manual_seed(mix64(index if seed is None else seed))
        for _ in range(len(self.samples)):
            candidate = int(torch.randint(len(self.samples), (1,), generator=generator))
            if candidate == index or candidate in self._unreadable:
                continue  # the same draws whether or not this process knew it was unreadable
            try:
                return candidate, self.loader(self.samples[candidate][0])
            except CorruptImageError as err:
                self._note_unreadable(candidate, err)
        raise CorruptImageError(
            f"No readable replacement found for {self.samples[index][0]} under {self.root} "
            f"after {len(self.samples)} draws; replace or delete the unreadable files.")

    def _note_unreadable(self, index: int, err: CorruptImageError) -> None:
        """Warn about and record a newly found unreadable file; stop past ``max_fraction``."""
        if index in self._unreadable:
            return
        self._unreadable.add(index)
        path, policy = self.samples[index][0], self.unreadable
        listed = policy.listed()
        if path not in listed:
            where = f" (listed in {policy.record})" if policy.record is not None else ""
            warnings.warn(f"Skipping an unreadable image{where}, another image of the dataset "
                          f"takes its place: {err}", stacklevel=3)
            policy.append(path)
        bad = {self.samples[i][0] for i in self._unreadable} | (listed & self._paths)
        if len(bad) > policy.max_fraction * len(self.samples):
            listing = f"; all listed in {policy.record}" if policy.record is not None else ""
            admits = math.ceil(100 * len(bad) / len(self.samples)) / 100
            raise CorruptImageError(
                f"{len(bad)} of the {len(self.samples)} images under {self.root} are "
                f"unreadable, more than max_corrupt_fraction={policy.max_fraction:g} (the last: "
                f"{path}{listing}): replace or delete them, or raise max_corrupt_fraction "
                f"(--data.max_corrupt_fraction {admits:g} allows {len(bad)}).")


class ImageFolderDataset(ReplacingDataset):
    """Images under a folder, labeled by class sub-folder or unlabeled.

    Args:
        root: The folder.
        labeled: ``True``: ``root/<class>/<image>`` with targets = class index (sorted names);
            ``False``: every image under ``root`` with target -1; ``None``: labeled when ``root``
            holds only sub-folders (no loose images).
        transform: Applied to the PIL image (e.g. a :class:`MultiViewTransform`).
        hint: Appended to the missing/empty-directory errors (how to get the data).
        unreadable: What an image that cannot be decoded does; None raises
            :class:`CorruptImageError` (``UnreadableImages()``).
        loader: Reads a file (:func:`load_image`: RGB PIL image;
            :func:`ssl_lightning.data.arrays.load_array`: float ``(C, H, W)`` tensor of any
            channel count and bit depth); raises :class:`CorruptImageError` for a bad file.
        extensions: The files listed (``indexing.ARRAY_EXTENSIONS`` adds ``.npy``).

    Raises:
        FileNotFoundError: ``root`` is missing or holds no images.
    """

    def __init__(
        self,
        root: str | Path,
        labeled: bool | None = None,
        transform: Callable[[Image.Image], Any] | None = None,
        hint: str = "",
        unreadable: UnreadableImages | None = None,
        loader: Callable[[str], Any] | None = None,
        extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
    ) -> None:
        self.root = check_directory(root, hint)
        self.loader = loader if loader is not None else load_image
        self.labeled = has_class_folders(self.root) if labeled is None else labeled
        self.transform = transform
        self.unreadable = unreadable if unreadable is not None else UnreadableImages()
        super().__init__()
        self.classes, files = index_images(self.root, self.labeled, extensions=extensions)
        self.samples = [(path, index if self.labeled else UNLABELED)
                        for index, paths in enumerate(files) for path in paths]
        if not self.samples:
            layout = f"{self.root}/<class>/<image>" if self.labeled else f"{self.root}/<image>"
            raise FileNotFoundError(
                f"No images ({', '.join(extensions)}) found in {self.root}; expected the "
                f"layout {layout}. {hint}".strip()
            )

    def __repr__(self) -> str:
        kind = f"{len(self.classes)} classes" if self.labeled else "unlabeled"
        return f"{type(self).__name__}({self.root}, {len(self)} images, {kind})"
