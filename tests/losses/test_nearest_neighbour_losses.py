"""The NNSiam and NNBYOL losses against float64 loop references: the targets are the nearest
neighbours in the support set, over steps where step n uses what the previous steps enqueued."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_references import FifoReference, cos, randn, unit
from torch import Tensor, nn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import NNBYOL, NNSiam

B, D, QUEUE = 4, 5, 8


def _nn_steps(model: nn.Module, byol: bool, steps: list[dict[str, Tensor]]):
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


@pytest.mark.parametrize("name", ["nnsiam", "nnbyol"])
def test_nearest_neighbour_targets_equal_the_loop(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    heads = dict(projection_hidden_dim=8, projection_dim=D, queue_size=QUEUE)
    model = (NNSiam(SmallConvNet((4, 8)), predictor_hidden_dim=8, **heads) if name == "nnsiam"
             else NNBYOL(SmallConvNet((4, 8)), **heads)).double()
    steps = [{k: randn(g, B, D) for k in ("p1", "p2", "z1", "z2")} for _ in range(3)]
    got, want = _nn_steps(model, name == "nnbyol", steps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert int(model.support_set.queue_ptr) == (3 * B) % QUEUE


@pytest.mark.parametrize("cls", [NNSiam, NNBYOL])
def test_nearest_neighbour_methods_refuse_an_empty_support_set(cls: type) -> None:
    with pytest.raises(ValueError, match="queue_size .* must be >= 1, got 0"):
        cls(SmallConvNet((4, 8)), queue_size=0)
