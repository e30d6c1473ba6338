"""All4One (Estepa et al. 2023): its feature term's column norms and cross-correlation are
sums over every rank's samples; from each rank's own batch (solo-learn's) it differs from one
process."""

from __future__ import annotations

import pytest
from torch import Tensor

from ssl_lightning.methods import All4One
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import assert_two_processes_equal_one
from ssl_lightning.testing.trainer_runs import KeyedViews

OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)


class _LocalStatisticsAll4One(All4One):
    """Known-bad: the feature term's column norms and cross-correlation from this rank only."""

    def reduce_sum(self, x: Tensor) -> Tensor:
        return x


def _local_statistics() -> All4One:
    model = method_entry("all4one").small(**OPTIM)
    model.__class__ = _LocalStatisticsAll4One
    return model


@pytest.mark.slow
def test_feature_statistics_of_each_rank_alone_differ_from_one_process() -> None:
    with pytest.raises(AssertionError, match="projector"):
        assert_two_processes_equal_one(_local_statistics, KeyedViews(24, (8, 8)))
