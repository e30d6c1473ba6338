"""Pieces of the loss tests' float64 loop references (numpy, one sample at a time): cosine,
unit vectors, seeded float64 draws and a FIFO queue of rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


class FifoReference:
    """A queue of rows in plain Python: ``put`` overwrites the oldest rows."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.ptr = [r.copy() for r in rows], 0

    def put(self, keys: np.ndarray) -> None:
        for key in keys:
            self.rows[self.ptr] = key.copy()
            self.ptr = (self.ptr + 1) % len(self.rows)

    def nearest(self, z: np.ndarray) -> np.ndarray:
        return self.rows[int(np.argmax([cos(z, r) for r in self.rows]))]
