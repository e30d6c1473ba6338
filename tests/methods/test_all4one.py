"""All4One (Estepa et al. 2023): its transformer and shift predictor are trained; bad settings
fail in ``__init__`` with the value named; its feature term's column norms and cross-correlation
are sums over every rank's samples, and from each rank's own batch (solo-learn's) they differ
from one process."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import All4One
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import assert_two_processes_equal_one
from ssl_lightning.testing.trainer_runs import KeyedViews

OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)
HEADS = dict(projection_hidden_dim=16, projection_dim=8, queue_size=16, head_batch_norm=False)
SMALL = dict(neighbours=3, transformer_layers=1, transformer_heads=2, predictor_hidden_dim=8)


def test_all4one_trains_its_transformer_and_shift_predictor() -> None:
    model = All4One(SmallConvNet((4, 8), norm="group"), **HEADS, **SMALL)
    loss, _ = model.training_loss(
        [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)])
    loss.backward()
    for part in (model.transformer, model.shift_predictor, model.predictor, model.projector):
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in part.parameters())
    assert int(model.support_set.queue_ptr) == 4


@pytest.mark.parametrize("make, message", [
    (lambda b: All4One(b, neighbours=1), "neighbours"),
    (lambda b: All4One(b, queue_size=4, neighbours=5), "neighbours"),
    (lambda b: All4One(b, projection_dim=12, transformer_heads=8), "transformer_heads"),
    (lambda b: All4One(b, transformer_dropout=1.0), "dropout"),
    (lambda b: All4One(b, feature_weight=-1.0), "feature_weight"),
])
def test_bad_settings_fail_in_init(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make(SmallConvNet((4, 8), norm="group"))


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
