"""Pieces of the loss tests' float64 loop references (numpy, one sample at a time): cosine,
unit vectors, seeded float64 draws and a FIFO queue of rows; and the bf16-autocast check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def nearest_neighbour_steps(model: Any, byol: bool, steps: list[dict[str, Any]]
                            ) -> tuple[list[float], list[float]]:
    """The method's loss of each step and the float64 loop reference (NNSiam: D(p1, NN(z2))/2 +
    D(p2, NN(z1))/2; NNBYOL: (2 - 2cos) + (2 - 2cos)), the support set filled by each step's z1."""
    support = FifoReference(model.support_set.queue.numpy())
    got, want = [], []
    for outputs in steps:
        got.append(float(model.loss_from_outputs(dict(outputs))))
        o = {k: v.numpy() for k, v in outputs.items()}
        nn1 = [support.nearest(z) for z in o["z1"]]
        nn2 = [support.nearest(z) for z in o["z2"]]
        c1 = np.mean([cos(p, t) for p, t in zip(o["p1"], nn2, strict=True)])
        c2 = np.mean([cos(p, t) for p, t in zip(o["p2"], nn1, strict=True)])
        # NNSiam: D(p1, NN(z2))/2 + D(p2, NN(z1))/2; NNBYOL: (2 − 2cos) + (2 − 2cos)
        want.append(4 - 2 * (c1 + c2) if byol else -(c1 + c2) / 2)
        support.put(np.stack([unit(z) for z in o["z1"]]))
    return got, want


def assert_computes_in_fp32_under_bf16(loss_fn: Callable[..., Tensor], num_inputs: int = 2,
                                       **forward_tolerance: float) -> None:
    """``loss_fn`` of ``num_inputs`` bf16 embeddings (a Linear under CPU bf16 autocast) returns
    fp32 and equals, to fp32 rounding, ``loss_fn`` of the same bf16-rounded values cast to fp32
    (a bf16 matmul or variance inside the loss would be off by ~1e-3 relative). With
    ``forward_tolerance`` (rtol, atol): also close to the loss of the all-fp32 forward, which
    differs only by the bf16 rounding of the embeddings."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6)
    xs = [torch.randn(16, 8) for _ in range(num_inputs)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [layer(x) for x in xs]
        loss = loss_fn(*outs)
    assert outs[0].dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_fn(*(o.float() for o in outs)), rtol=1e-6, atol=0)
    if forward_tolerance:
        torch.testing.assert_close(loss, loss_fn(*(layer(x) for x in xs)), **forward_tolerance)
