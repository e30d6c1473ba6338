"""Images as arrays of any channel count and bit depth (remote sensing, microscopy, medical).

:func:`load_array` reads a file into a float32 ``(C, H, W)`` tensor in the file's own units, with
no scaling and no clipping: 8- and 16-bit integers are exact in float32, so a 16-bit TIFF or a
13-band Sentinel-2 tile keeps its full range, and normalisation is left to the per-channel
statistics of the data (``python -m ssl_lightning channel-stats``,
:mod:`ssl_lightning.data.channel_stats`).

Formats: TIFF through ``tifffile`` (the ``multispectral`` extra; any number of bands, planar,
interleaved or one page per band: the one axis besides Y and X is the band axis), NumPy
``.npy`` arrays (``(H, W)`` or ``(C, H, W)``), and everything PIL reads (PNG, JPEG, ...
including 16-bit grayscale PNG). A file that holds no pixel, a NaN or an infinite value, or a
``.npy`` header that claims more bytes than the file holds, is refused naming the file.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ssl_lightning.data.datasets import CorruptImageError


def _read_tiff(path: Path) -> np.ndarray:
    try:
        import tifffile
    except ImportError as err:
        raise ImportError(
            f"Reading {path} needs tifffile: pip install 'ssl_lightning[multispectral]'.") from err
    with tifffile.TiffFile(path) as tif:
        if not tif.series:
            raise ValueError("it holds no image")
        pixels, axes = tif.series[0].asarray(), tif.series[0].axes
    if "Y" not in axes or "X" not in axes:
        raise ValueError(f"its axes are {axes!r}, without Y and X")
    spatial = [axes.index("Y"), axes.index("X")]
    others = [i for i in range(len(axes)) if i not in spatial and pixels.shape[i] > 1]
    if len(others) > 1:
        raise ValueError(f"its axes are {axes!r} of shape {pixels.shape}; one image of Y, X "
                         "and at most one band axis (samples, channels or pages) is read")
    pixels = np.moveaxis(pixels, others + spatial, list(range(len(others) + 2)))
    return pixels.reshape(pixels.shape[:len(others) + 2])


def _read_npy(path: Path) -> np.ndarray:
    """A ``.npy`` array of a numeric dtype, its header checked against the file's size before
    anything is allocated (a damaged header cannot ask for gigabytes)."""
    with open(path, "rb") as file:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(file)
        else:
            raise ValueError(f"its .npy format version {version} is not read (1.0 or 2.0)")
        if dtype.kind not in "iufb":
            raise ValueError(f"its dtype {dtype} is not numeric")
        needed = file.tell() + math.prod(shape) * dtype.itemsize
        size = os.fstat(file.fileno()).st_size
        if size < needed:
            raise ValueError(f"its header claims a {dtype} array of shape {shape} "
                             f"({needed:,} bytes) but the file holds {size:,} bytes: it is "
                             "truncated or damaged")
        file.seek(0)
        return np.lib.format.read_array(file, allow_pickle=False)


def _read_any(path: Path) -> np.ndarray:
    suffix = path.suffix.lower()
    if suffix in (".tif", ".tiff"):
        return _read_tiff(path)
    if suffix == ".npy":
        return _read_npy(path)
    with Image.open(path) as image:
        pixels = np.asarray(image)
    return np.moveaxis(pixels, -1, 0) if pixels.ndim == 3 else pixels


def read_pixels(path: str | Path) -> np.ndarray:
    """The image at ``path`` as a ``(C, H, W)`` array of the file's own dtype, checked.

    Raises:
        CorruptImageError: naming the file, when it cannot be read, is not a 2-D image of one or
            more channels, holds no pixel, holds NaN or infinite values, or holds integers that
            float32 does not represent exactly.
    """
    path = Path(path)
    try:
        pixels = _read_any(path)
        if pixels.ndim == 2:
            pixels = pixels[None]
        if pixels.ndim != 3:
            raise ValueError(f"its shape is {pixels.shape}; (H, W) or (C, H, W) is read")
        if pixels.dtype.kind not in "iufb":
            raise ValueError(f"its dtype {pixels.dtype} is not numeric")
        if not pixels.size:
            raise ValueError(f"it holds no pixel (shape {pixels.shape})")
        if pixels.dtype.kind == "f" and not np.isfinite(pixels).all():
            raise ValueError(f"it holds {(~np.isfinite(pixels)).sum()} NaN or infinite "
                             "value(s)")
        if pixels.dtype.kind in "iu" and pixels.dtype.itemsize > 2 and \
                int(np.abs(pixels).max()) > 2**24:
            raise ValueError(f"its {pixels.dtype} values exceed 2**24, which float32 rounds; "
                             "convert them to float yourself")
        return pixels
    except (OSError, ValueError, SyntaxError, IndexError, Image.DecompressionBombError) as err:
        raise CorruptImageError(
            f"Cannot read image file {path}: {err}. Replace or delete this file.") from err


def load_array(path: str | Path) -> Tensor:
    """The image at ``path`` as a float32 ``(C, H, W)`` tensor in the file's units (checked
    as :func:`read_pixels`)."""
    return torch.from_numpy(np.ascontiguousarray(read_pixels(path), dtype=np.float32))
