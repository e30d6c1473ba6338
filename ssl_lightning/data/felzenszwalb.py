"""Felzenszwalb–Huttenlocher segments of an image: DetCon's default unsupervised masks.

Felzenszwalb & Huttenlocher, "Efficient Graph-Based Image Segmentation", IJCV 2004, through
scikit-image's ``skimage.segmentation.felzenszwalb`` (an optional dependency:
``pip install ssl_lightning[segments]``). DetCon (Hénaff et al., ICCV 2021) computes them once per
image on the original image, before any augmentation (the authors' ``detcon`` repository,
``generate_fh_masks_for_imagenet.py``: scale 1000, minimum segment size 1000 pixels, scikit-image's
default smoothing σ = 0.8, on the decoded uint8 image).

:class:`FelzenszwalbSegmenter` returns an integer segment map (H, W) with ids 0..S−1. The result
is a pure function of the pixels and the parameters, so it is kept in a bounded in-memory cache
keyed by a digest of the pixels (the same image fetched again in a later epoch is not segmented
again).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import Tensor


def _felzenszwalb() -> Any:
    try:
        from skimage.segmentation import felzenszwalb
    except ImportError as err:
        raise ImportError("Felzenszwalb segments need scikit-image: pip install "
                          "ssl_lightning[segments] (or pip install scikit-image).") from err
    return felzenszwalb


def image_array(image: Any) -> np.ndarray:
    """A PIL image, an (H, W[, C]) array or a (C, H, W) tensor as an (H, W, C) array (its own
    dtype: uint8 images stay uint8, as the authors segment them)."""
    if isinstance(image, Tensor):
        array = image.detach().cpu().numpy()
        array = array[None] if array.ndim == 2 else array
        if array.ndim != 3:
            raise ValueError(f"Expected an image tensor (C, H, W), got {tuple(image.shape)}.")
        return np.ascontiguousarray(np.moveaxis(array, 0, -1))
    array = np.asarray(image)
    array = array[..., None] if array.ndim == 2 else array
    if array.ndim != 3:
        raise ValueError(f"Expected an image (H, W[, C]), got an array of shape {array.shape}.")
    return np.ascontiguousarray(array)


class FelzenszwalbSegmenter:
    """Felzenszwalb–Huttenlocher segment maps, cached.

    Args:
        scale: Larger values give larger segments (the authors: 1000, on ImageNet images).
        sigma: σ of the Gaussian smoothing before segmenting (scikit-image's default 0.8, which
            the authors keep).
        min_size: Smallest segment in pixels; smaller ones are merged into a neighbour (1000).
        cache_size: Segment maps kept in memory per process (least recently used dropped first;
            int16 when the ids fit: H·W·2 bytes each, 8 MB for 4096 CIFAR images, about 1.5 GB
            for 4096 ImageNet-sized ones); 0: none.
    """

    def __init__(self, scale: float = 1000.0, sigma: float = 0.8, min_size: int = 1000,
                 cache_size: int = 4096) -> None:
        if scale <= 0 or sigma < 0 or min_size < 0 or cache_size < 0:
            raise ValueError(f"Felzenszwalb segments need scale > 0, sigma >= 0, min_size >= 0 "
                             f"and cache_size >= 0; got {scale}, {sigma}, {min_size}, "
                             f"{cache_size}.")
        _felzenszwalb()  # fail at construction, before any training step
        self.scale, self.sigma, self.min_size = float(scale), float(sigma), int(min_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def _key(self, array: np.ndarray) -> bytes:
        digest = hashlib.blake2b(array.tobytes(), digest_size=20)
        digest.update(repr((array.shape, array.dtype.str)).encode())
        return digest.digest()

    def __call__(self, image: Any) -> Tensor:
        """The segment map (H, W), int64 ids 0..S−1, of ``image`` (PIL, array or tensor)."""
        array = image_array(image)
        key = self._key(array) if self.cache_size else b""
        cached = self._cache.get(key) if self.cache_size else None
        if cached is None:
            labels = _felzenszwalb()(array, scale=self.scale, sigma=self.sigma,
                                     min_size=self.min_size, channel_axis=-1)
            cached = labels.astype(np.int16 if labels.max() < 2**15 else np.int32)
            if self.cache_size:
                self._cache[key] = cached
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        elif self.cache_size:
            self._cache.move_to_end(key)
        return torch.from_numpy(cached.astype(np.int64))

    def __repr__(self) -> str:
        return (f"FelzenszwalbSegmenter(scale={self.scale:g}, sigma={self.sigma:g}, "
                f"min_size={self.min_size})")
