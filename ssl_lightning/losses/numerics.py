"""Small tensor helpers shared by the losses."""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_fp32(x: Tensor) -> Tensor:
    """``x`` in fp32, or unchanged when already fp32/fp64 (so float64 checks stay float64).

    Losses call this inside ``torch.autocast(enabled=False)`` so that bf16/fp16 activations are
    normalised, multiplied and reduced in fp32.
    """
    return x.to(torch.promote_types(x.dtype, torch.float32))


def off_diagonal(matrix: Tensor) -> Tensor:
    """The off-diagonal entries of a square matrix, flattened."""
    n = matrix.shape[0]
    return matrix.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()
