"""NNBYOL (BYOL with nearest-neighbour targets): the loss against a float64 loop reference over
steps where step n uses what the previous steps enqueued, and an empty support set refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_references import nearest_neighbour_steps, randn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import NNBYOL

B, D, QUEUE = 4, 5, 8


def test_nearest_neighbour_targets_equal_the_loop() -> None:
    g = torch.Generator().manual_seed(2)
    heads = dict(projection_hidden_dim=8, projection_dim=D, queue_size=QUEUE)
    model = NNBYOL(SmallConvNet((4, 8)), **heads).double()
    steps = [{k: randn(g, B, D) for k in ("p1", "p2", "z1", "z2")} for _ in range(3)]
    got, want = nearest_neighbour_steps(model, True, steps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert int(model.support_set.queue_ptr) == (3 * B) % QUEUE


def test_an_empty_support_set_is_refused() -> None:
    with pytest.raises(ValueError, match="queue_size .* must be >= 1, got 0"):
        NNBYOL(SmallConvNet((4, 8)), queue_size=0)
