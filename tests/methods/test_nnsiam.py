"""NNSiam (Dwibedi et al. 2021 with SimSiam): the loss against a float64 loop reference over
steps where step n uses what the previous steps enqueued, an empty support set refused, and its
support set holds the projections of the whole (gathered) batch: one filled from each rank's own
projections differs from one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_references import nearest_neighbour_steps, randn
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import NNSiam
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import assert_two_processes_equal_one
from ssl_lightning.testing.trainer_runs import KeyedViews

OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)
B, D, QUEUE = 4, 5, 8


def test_nearest_neighbour_targets_equal_the_loop() -> None:
    g = torch.Generator().manual_seed(2)
    heads = dict(projection_hidden_dim=8, projection_dim=D, queue_size=QUEUE)
    model = NNSiam(SmallConvNet((4, 8)), predictor_hidden_dim=8, **heads).double()
    steps = [{k: randn(g, B, D) for k in ("p1", "p2", "z1", "z2")} for _ in range(3)]
    got, want = nearest_neighbour_steps(model, False, steps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert int(model.support_set.queue_ptr) == (3 * B) % QUEUE


def test_an_empty_support_set_is_refused() -> None:
    with pytest.raises(ValueError, match="queue_size .* must be >= 1, got 0"):
        NNSiam(SmallConvNet((4, 8)), queue_size=0)


class _LocalSupportSetNNSiam(NNSiam):
    """Known-bad: the support set receives this rank's projections only."""

    def gather(self, x: Tensor) -> Tensor:
        return x if not x.requires_grad else super().gather(x)


def _local_support_set() -> NNSiam:
    model = method_entry("nnsiam").small(**OPTIM)
    model.__class__ = _LocalSupportSetNNSiam
    return model


@pytest.mark.slow
def test_a_support_set_filled_per_rank_differs_from_one_process() -> None:
    with pytest.raises(AssertionError, match="support_set.queue"):
        assert_two_processes_equal_one(_local_support_set, KeyedViews(24, (8, 8)))
