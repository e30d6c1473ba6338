"""The MoCo v2+ loss against a float64 loop reference of MoCo's Eq. (1) over two queues (one per
view) across steps (each step uses what the previous ones enqueued); the known-bad variant that
enqueues one view only is caught by the same comparison."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from loss_references import FifoReference, randn, unit
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MoCoV2Plus

B, D, QUEUE = 4, 5, 8


def infonce_reference(q: np.ndarray, k: np.ndarray, negatives: list, t: float) -> float:
    """MoCo Eq. (1) per query: −log e^{q·k+/T} / (e^{q·k+/T} + Σ e^{q·k_i/T}), unit vectors."""
    total = 0.0
    for qi, ki in zip(q, k, strict=True):
        positive = math.exp(unit(qi) @ unit(ki) / t)
        total -= math.log(positive / (positive + sum(math.exp(unit(qi) @ unit(n) / t)
                                                       for n in negatives)))
    return total / len(q)


class _OneQueueEnqueued(MoCoV2Plus):
    """Known-bad: only the view-2 keys are enqueued; the view-1 queue never changes."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        loss = (self.criterion(outputs["query1"], outputs["key2"], self.queue.negatives())
                + self.criterion(outputs["query2"], outputs["key1"],
                                 self.queue_view1.negatives())) / 2
        self.queue.enqueue(self.gather_no_grad(outputs["key2"]))
        return loss


def _moco_steps(cls: type, steps: list[dict[str, Tensor]]) -> tuple[list[float], list[float]]:
    model = cls(SmallConvNet((4, 8)), projection_hidden_dim=8, projection_dim=D,
                queue_size=QUEUE, temperature=0.3).double()
    queue2 = FifoReference(model.queue.queue.numpy())
    queue1 = FifoReference(model.queue_view1.queue.numpy())
    got, want = [], []
    for outputs in steps:
        got.append(float(model.loss_from_outputs(outputs)))
        o = {k: v.numpy() for k, v in outputs.items()}
        want.append((infonce_reference(o["query1"], o["key2"], queue2.rows, 0.3)
                     + infonce_reference(o["query2"], o["key1"], queue1.rows, 0.3)) / 2)
        queue2.put(np.stack([unit(k) for k in o["key2"]]))
        queue1.put(np.stack([unit(k) for k in o["key1"]]))
    return got, want


def test_moco_v2_plus_loss_and_per_view_queues_equal_the_loop() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [{"query1": randn(g, B, D), "query2": randn(g, B, D),
              "key1": torch.nn.functional.normalize(randn(g, B, D), dim=1),
              "key2": torch.nn.functional.normalize(randn(g, B, D), dim=1)} for _ in range(3)]
    got, want = _moco_steps(MoCoV2Plus, steps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    bad, _ = _moco_steps(_OneQueueEnqueued, steps)
    assert bad[0] == pytest.approx(want[0], rel=1e-12)  # same first step ...
    assert abs(bad[2] - want[2]) > 1e-4  # ... then the view-1 queue is stale


def test_moco_v2_plus_refuses_the_one_way_loss() -> None:
    with pytest.raises(ValueError, match="symmetric=False"):
        MoCoV2Plus(SmallConvNet((4, 8)), symmetric=False)
