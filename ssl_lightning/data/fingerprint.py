"""A fingerprint of a training set's file list, saved with the data-loader position: a position
inside an epoch names samples by index, so it holds only for the files it was written on."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from torch.utils.data import Dataset


def dataset_fingerprint(dataset: Dataset) -> str | None:
    """SHA-256 of every sample's name (relative to the dataset's ``root``) and size in bytes, in
    index order (a name that is no local file, e.g. a shard's sample, counts by its name).

    The datasets list their files already (``samples``, see
    :class:`~ssl_lightning.data.datasets.ReplacingDataset`); this adds one ``stat`` per file.
    None for a dataset without such a list (wrappers with a ``dataset`` attribute are looked
    through).
    """
    found: Any = dataset
    while not hasattr(found, "samples") and hasattr(found, "dataset"):
        found = found.dataset
    samples = getattr(found, "samples", None)
    if not isinstance(samples, list):
        return None
    root = str(getattr(found, "root", ""))
    digest = hashlib.sha256()
    for path, _ in samples:
        path = str(path)
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        name = path[len(root):].lstrip("/") if root and path.startswith(root) else path
        digest.update(f"{name}\0{size}\n".encode())
    return digest.hexdigest()
