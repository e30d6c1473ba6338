"""NNSiam (Dwibedi et al. 2021 with SimSiam): its support set holds the projections of the whole
(gathered) batch; one filled from each rank's own projections differs from one process."""

from __future__ import annotations

import pytest
from torch import Tensor

from ssl_lightning.methods import NNSiam
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import assert_two_processes_equal_one
from ssl_lightning.testing.trainer_runs import KeyedViews

OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)


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
