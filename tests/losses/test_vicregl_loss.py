"""VICRegLLoss against a float64 loop over the paper's terms and against lightly's VICRegLLoss,
and the filtered nearest-neighbour matching it uses."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from ssl_lightning.losses.dense_matching import best_matches, pairwise_distance
from ssl_lightning.losses.vicregl import VICRegLLoss

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = [(3, 3), (3, 3), (2, 2), (2, 2)]  # two global views, two local crops


def _inputs(seed: int = 0, batch: int = 6) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    emb = [torch.randn(batch, 5, generator=g, dtype=torch.float64) for _ in SIZES]
    maps = [torch.randn(batch, h * w, 4, generator=g, dtype=torch.float64) for h, w in SIZES]
    where = [torch.rand(batch, h * w, 2, generator=g, dtype=torch.float64) for h, w in SIZES]
    return emb, maps, where


def _variance(x: list[list[float]]) -> float:
    """Mean over features of max(0, 1 − sqrt(unbiased variance + 1e-4)); x: B rows."""
    b, d = len(x), len(x[0])
    total = 0.0
    for j in range(d):
        mean = sum(row[j] for row in x) / b
        var = sum((row[j] - mean) ** 2 for row in x) / (b - 1)
        total += max(0.0, 1 - math.sqrt(var + 1e-4))
    return total / d


def _covariance(x: list[list[float]]) -> float:
    """1/D Σ_{i≠j} C_ij² of the unbiased covariance of the B rows."""
    b, d = len(x), len(x[0])
    mean = [sum(row[j] for row in x) / b for j in range(d)]
    total = 0.0
    for i in range(d):
        for j in range(d):
            if i != j:
                c = sum((row[i] - mean[i]) * (row[j] - mean[j]) for row in x) / (b - 1)
                total += c * c
    return total / d


def _vicreg(x: Tensor, y: Tensor, nu: float) -> float:
    """λ·mse + μ·(v(x)+v(y))/2 + ν·(c(x)+c(y)), statistics per slot k of (B, K, D) averaged."""
    mse = float(((x - y) ** 2).mean())
    slots = range(x.shape[1])
    var = sum(_variance(x[:, k].tolist()) + _variance(y[:, k].tolist()) for k in slots)
    cov = sum(_covariance(x[:, k].tolist()) + _covariance(y[:, k].tolist()) for k in slots)
    return 25 * mse + 25 * var / 2 / len(slots) + nu * cov / len(slots)


def _matched(source: Tensor, target: Tensor, dist_source: Tensor, dist_target: Tensor,
             k: int) -> float:
    """Per sample: each source location's nearest target location, the k closest pairs kept
    closest first; then VICReg (ν/2) over the batch per slot."""
    xs, ys = [], []
    for i in range(len(source)):
        pairs = []
        for n in range(source.shape[1]):
            d = [float(torch.dist(dist_source[i, n], dist_target[i, m]))
                 for m in range(target.shape[1])]
            m = min(range(len(d)), key=lambda j: d[j])
            pairs.append((d[m], n, m))
        pairs.sort()
        xs.append(torch.stack([source[i, n] for _, n, _ in pairs[:k]]))
        ys.append(torch.stack([target[i, m] for _, _, m in pairs[:k]]))
    return _vicreg(torch.stack(xs), torch.stack(ys), nu=0.5)


def _reference(emb: list[Tensor], maps: list[Tensor], where: list[Tensor],
               num_matches: tuple[int, int], alpha: float = 0.75) -> float:
    pairs = [(a, b) for a in range(2) for b in range(len(emb)) if b != a]
    inv = sum(float(((emb[a] - emb[b]) ** 2).mean()) for a, b in pairs) / len(pairs)
    var = sum(_variance(e.tolist()) for e in emb) / len(emb)
    cov = sum(_covariance(e.tolist()) for e in emb) / len(emb)
    global_term = 25 * inv + 25 * var + 1 * cov
    local = 0.0
    for a, b in pairs:
        k0, k1 = num_matches
        local += (_matched(maps[a], maps[b], maps[a], maps[b], k0)
                  + _matched(maps[b], maps[a], maps[b], maps[a], k1)) / 2
        local += (_matched(maps[a], maps[b], where[a], where[b], k0)
                  + _matched(maps[b], maps[a], where[b], where[a], k1)) / 2
    return alpha * global_term + (1 - alpha) * local / len(pairs)


@pytest.mark.parametrize("num_matches", [(20, 4), (3, 2)])
def test_vicregl_loss_equals_the_papers_terms(num_matches: tuple[int, int]) -> None:
    emb, maps, where = _inputs()
    loss = VICRegLLoss(num_matches=num_matches)(emb, maps, where)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(_reference(emb, maps, where, num_matches), rel=1e-12)


@pytest.mark.parametrize("num_matches", [(20, 4), (3, 2)])
def test_vicregl_loss_equals_lightlys(num_matches: tuple[int, int]) -> None:
    lightly_loss = pytest.importorskip("lightly.loss").VICRegLLoss
    emb, maps, where = _inputs(1)
    grid = [(m.reshape(len(m), h, w, -1), x.reshape(len(x), h, w, 2))
            for m, x, (h, w) in zip(maps, where, SIZES, strict=True)]
    theirs = lightly_loss(num_matches=num_matches)(
        [(emb[i], grid[i][0]) for i in range(2)], [grid[i][1] for i in range(2)],
        [(emb[i], grid[i][0]) for i in range(2, 4)], [grid[i][1] for i in range(2, 4)])
    ours = VICRegLLoss(num_matches=num_matches)(emb, maps, where)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12)


def test_vicregl_loss_of_two_views_has_gradients_for_every_input_feature() -> None:
    emb, maps, where = _inputs(2)
    emb, maps = [e[:, :].requires_grad_() for e in emb[:2]], [m.requires_grad_() for m in maps[:2]]
    VICRegLLoss(num_matches=(9, 9))(emb, maps, where[:2]).backward()
    assert all(m.grad is not None and bool((m.grad.abs().sum(2) > 0).all()) for m in maps)


def test_best_matches_keeps_the_closest_pairs_closest_first() -> None:
    distances = torch.tensor([[[5.0, 1.0], [0.5, 3.0], [2.0, 2.5]]])
    source, target = best_matches(distances, 2)
    assert source.tolist() == [[1, 0]] and target.tolist() == [[0, 1]]
    assert best_matches(distances, 10)[0].tolist() == [[1, 0, 2]]
    where = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])
    assert pairwise_distance(where, where, "l2")[0, 0, 1] == 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(alpha=1.5), "alpha must be in"), (dict(num_matches=(0, 4)), "num_matches must be"),
    (dict(variance_weight=-1.0), "variance_weight must be >= 0")])
def test_vicregl_loss_refuses_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VICRegLLoss(**kwargs)


def test_vicregl_loss_refuses_locations_that_do_not_fit_the_features() -> None:
    emb, maps, where = _inputs()
    with pytest.raises(ValueError, match=r"need locations \(B, N, 2\)"):
        VICRegLLoss()(emb[:2], maps[:2], [where[0], where[2]])
