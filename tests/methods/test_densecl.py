"""DenseCL: its loss against a float64 loop over the paper's equations, the location matching,
the method's queues and heads, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import DenseCLLoss
from ssl_lightning.losses.dense_matching import (
    gather_locations,
    map_to_locations,
    nearest_locations,
)
from ssl_lightning.methods import DenseCL, MoCoV2

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(projection_hidden_dim=16, projection_dim=8, queue_size=8, momentum_base=0.9,
             optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0, image_size=8)


def _infonce_row(q: Tensor, k: Tensor, negatives: Tensor, t: float) -> float:
    """−log exp(q·k/τ) / (exp(q·k/τ) + Σ exp(q·n/τ)) for one query, on unit vectors."""
    q, k, negatives = F.normalize(q, dim=0), F.normalize(k, dim=0), F.normalize(negatives, dim=1)
    positive = math.exp(float(q @ k) / t)
    return -math.log(positive / (positive + sum(math.exp(float(q @ n) / t) for n in negatives)))


def _reference(q, k, neg, qd, kd, qb, kb, neg_dense, t: float, lam: float) -> float:
    """DenseCL Eqs. (1)-(3), one sample and one location at a time."""
    global_term = sum(_infonce_row(q[i], k[i], neg, t) for i in range(len(q))) / len(q)
    dense_rows = []
    for i in range(len(qd)):
        for r in range(qd.shape[1]):
            cos = [float(F.cosine_similarity(qb[i, r], kb[i, m], dim=0))
                   for m in range(kb.shape[1])]
            j = max(range(len(cos)), key=lambda m: cos[m])  # first of the most similar
            dense_rows.append(_infonce_row(qd[i, r], kd[i, j], neg_dense, t))
    return (1 - lam) * global_term + lam * sum(dense_rows) / len(dense_rows)


def _inputs(seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, n, m, d, c = 3, 5, 4, 6, 7
    shapes = [(b, d), (b, d), (10, d), (b, n, d), (b, m, d), (b, n, c), (b, m, c), (9, d)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


@pytest.mark.parametrize("lam", [0.5, 0.2])
def test_densecl_loss_equals_the_papers_equations(lam: float) -> None:
    inputs = _inputs()
    loss = DenseCLLoss(temperature=0.3, dense_weight=lam)(*inputs)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(_reference(*inputs, t=0.3, lam=lam), rel=1e-12)


def test_densecl_positives_follow_the_backbone_features_not_the_projections() -> None:
    # Key projections that favour one location and backbone features that favour another:
    # a loss matching by the projections (or not matching at all) gives another value.
    q, k, neg, qd, kd, qb, kb, neg_dense = _inputs(1)
    kb = torch.cat([kb[:, 1:], kb[:, :1]], dim=1)  # the backbone's nearest keys move
    loss = DenseCLLoss(0.3, 1.0)(q, k, neg, qd, kd, qb, kb, neg_dense)
    assert float(loss) == pytest.approx(
        _reference(q, k, neg, qd, kd, qb, kb, neg_dense, 0.3, 1.0), rel=1e-12)
    by_projection = DenseCLLoss(0.3, 1.0)(q, k, neg, qd, kd, qd, kd, neg_dense)
    assert abs(float(loss) - float(by_projection)) > 1e-3


def test_matching_by_features_finds_a_permutation_and_gathers_it() -> None:
    g = torch.Generator().manual_seed(2)
    key = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    perm = torch.tensor([[3, 0, 5, 1, 4, 2], [1, 2, 3, 4, 5, 0]])
    query = 2.5 * gather_locations(key, perm)  # cosine ignores the scale
    assert torch.equal(nearest_locations(query, key), perm)
    assert torch.equal(nearest_locations(query / 2.5, key, distance="l2"), perm)
    assert torch.equal(gather_locations(key, perm)[1, 0], key[1, 1])


def test_map_to_locations_is_row_major() -> None:
    feature_map = torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2)
    locations = map_to_locations(feature_map)
    assert locations.shape == (2, 4, 3)
    assert torch.equal(locations[1, 2], feature_map[1, :, 1, 0])


def _views(seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)]


def test_densecl_step_fills_both_queues_with_the_second_views_keys() -> None:
    torch.manual_seed(0)
    model = DenseCL(SmallConvNet((8, 16), norm="group"), **SMALL).double()
    views = _views()
    outputs = model.forward_views(views)
    teacher_map, _ = model.teacher_backbone.forward_dense(views[1])
    dense_keys = model.teacher_dense_projector(map_to_locations(teacher_map))
    expected = F.normalize(dense_keys.mean(dim=1), dim=1)
    model.loss_from_outputs(outputs)
    assert torch.allclose(model.dense_queue.queue[:4], expected.detach())
    assert torch.allclose(model.queue.queue[:4], outputs["key2"])
    assert int(model.dense_queue.queue_ptr) == 4


def test_densecl_with_no_dense_weight_is_moco_v2() -> None:
    torch.manual_seed(0)
    densecl = DenseCL(SmallConvNet((8, 16), norm="group"), dense_weight=0.0, **SMALL).double()
    moco = MoCoV2(SmallConvNet((8, 16), norm="group"), **SMALL).double()
    moco.load_state_dict(densecl.state_dict(), strict=False)
    views = _views(3)
    loss = densecl.training_loss(views)[0]
    assert float(loss) == pytest.approx(float(moco.training_loss(views)[0]), rel=1e-12)


def test_densecl_refuses_a_dense_weight_outside_0_1() -> None:
    with pytest.raises(ValueError, match=r"dense_weight \(λ\) must be in \[0, 1\], got 1.5"):
        DenseCL(SmallConvNet((8, 16), norm="group"), dense_weight=1.5, **SMALL)


class _PooledOnly(nn.Module):
    num_features = 4

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=(2, 3)).repeat(1, 2)[:, :4]


def test_densecl_refuses_a_backbone_without_a_feature_map() -> None:
    with pytest.raises(ValueError, match="_PooledOnly has no dense features"):
        DenseCL(_PooledOnly(), **SMALL)
