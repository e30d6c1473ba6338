"""Torch files read as data: ``torch.load(weights_only=True)`` on the CPU, and a one-line error
naming the file, the cause and the fix when that is refused or fails (checkpoints, pretrained
weights, the metadata of a sharded checkpoint)."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch


def load_torch_data(path: str, what: str, fix: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, or a one-line ``ValueError`` naming
    ``what`` and ``path``, the cause (empty, truncated, not a torch file, pickled Python objects
    that could run code) and ``fix``.

    Args:
        path: An existing file.
        what: What the file is, for the message (``"Checkpoint"``, ``"pretrained_path"``).
        fix: The sentence telling the user what to do.
    """
    size = os.path.getsize(path)
    cut_short = ("The file is probably truncated (a run killed while saving, or a copy cut "
                 "short).")
    if size == 0:
        raise ValueError(f"{what} {path!r} is empty (0 bytes): nothing was saved. {cut_short} "
                         f"{fix}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))  # the object weights_only refused
        if found is None:  # not a pickle torch wrote (a text file, another format)
            raise ValueError(_unreadable(path, size, what, fix, cut_short)) from err
        raise ValueError(
            f"{what} {path!r} is refused: it pickles the Python object {found.group(1)} besides "
            "tensors and plain data, and loading it could run code (files are read with "
            f"torch.load(weights_only=True)). {fix}"
        ) from err
    except Exception as err:  # truncated, text or foreign files all fail differently
        raise ValueError(_unreadable(path, size, what, fix, cut_short)) from err


def _unreadable(path: str, size: int, what: str, fix: str, cut_short: str) -> str:
    with open(path, "rb") as file:
        is_zip = file.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
    cause = (f"the archive is incomplete or corrupt. {cut_short}" if is_zip
             else "it is not a file written by torch.save (a text file, or another format).")
    return f"{what} {path!r} cannot be read ({size} bytes): {cause} {fix}"
