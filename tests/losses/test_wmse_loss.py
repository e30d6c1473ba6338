"""W-MSE's loss equals a float64 loop of the paper's Eqs. (3)-(6): per sub-batch and view the
unbiased covariance, its Cholesky factor by the Cholesky–Banachiewicz recurrence, forward
substitution for L⁻¹(v − μ), then 2 − 2·cos over the view pairs, averaged over the splits.
Properties: whitened sub-batches have identity covariance; a rank's share (start, count) of
the loss averages to the whole; bad settings are refused."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses import WMSELoss
from ssl_lightning.losses.wmse import WhiteningError, whiten


def _cholesky(a: list[list[float]]) -> list[list[float]]:
    n = len(a)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = sum(low[i][k] * low[j][k] for k in range(j))
            low[i][j] = math.sqrt(a[i][i] - s) if i == j else (a[i][j] - s) / low[j][j]
    return low


def _whiten_loop(rows: list[list[float]], eps: float) -> list[list[float]]:
    w, d = len(rows), len(rows[0])
    mean = [sum(r[k] for r in rows) / w for k in range(d)]
    centred = [[r[k] - mean[k] for k in range(d)] for r in rows]
    cov = [[(1 - eps) * sum(c[i] * c[j] for c in centred) / (w - 1) + (eps if i == j else 0.0)
            for j in range(d)] for i in range(d)]
    low = _cholesky(cov)
    out = []
    for c in centred:  # solve L y = c
        y: list[float] = []
        for i in range(d):
            y.append((c[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i])
        out.append(y)
    return out


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _wmse_reference(v: torch.Tensor, perms: list[torch.Tensor], w: int, eps: float,
                    rows: range) -> float:
    n, views, _ = v.shape
    total = 0.0
    for perm in perms:
        whitened: dict[tuple[int, int], list[float]] = {}
        for g in range(n // w):
            members = [int(i) for i in perm[g * w:(g + 1) * w]]
            for view in range(views):
                out = _whiten_loop([v[m, view].tolist() for m in members], eps)
                for m, z in zip(members, out, strict=True):
                    whitened[m, view] = z
        pairs = [(i, j) for i in range(views) for j in range(i + 1, views)]
        total += sum(sum(2 - 2 * _cos(whitened[b, i], whitened[b, j]) for b in rows) / len(rows)
                     for i, j in pairs) / len(pairs)
    return total / len(perms)


def _data():  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    v = torch.randn(8, 3, 3, generator=g, dtype=torch.float64)
    v[:, 1] += 0.5 * v[:, 0]
    perms = [torch.randperm(8, generator=g) for _ in range(2)]
    return v, perms


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_wmse_loss_equals_the_loop(eps: float) -> None:
    v, perms = _data()
    got = WMSELoss(whitening_size=4, eps=eps)(v, perms)
    assert got.dtype == torch.float64
    assert abs(float(got) - _wmse_reference(v, perms, 4, eps, range(8))) < 1e-12


def test_rank_shares_average_to_the_whole_batch() -> None:
    v, perms = _data()
    loss = WMSELoss(whitening_size=4)
    shares = [loss(v, perms, start, 4) for start in (0, 4)]
    assert abs(float(sum(shares) / 2 - loss(v, perms))) < 1e-12
    assert abs(float(shares[1]) - _wmse_reference(v, perms, 4, 0.0, range(4, 8))) < 1e-12


def test_whitened_groups_have_identity_covariance() -> None:
    x = torch.randn(3, 50, 4, dtype=torch.float64) @ torch.randn(4, 4, dtype=torch.float64)
    z = whiten(x)
    cov = z.transpose(1, 2) @ z / (50 - 1)
    torch.testing.assert_close(cov, torch.eye(4, dtype=torch.float64).expand(3, 4, 4),
                               rtol=0, atol=1e-10)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="whitening_size must be >= 2, got 1"):
        WMSELoss(whitening_size=1)
    with pytest.raises(ValueError, match=r"eps must be in \[0, 1\), got 1.0"):
        WMSELoss(eps=1.0)
    v, perms = _data()
    with pytest.raises(ValueError, match="choose a whitening_size > 3 that divides"):
        WMSELoss(whitening_size=3)(v, perms)


def test_a_rank_deficient_batch_without_shrinkage_names_whitening_eps() -> None:
    """A collapsing run (embeddings on fewer than D directions) with whitening_eps 0: one clear
    error naming the setting and a value, not torch's raw Cholesky error; eps > 0 whitens."""
    v, perms = _data()
    collapsed = v.clone()
    collapsed[..., 2] = collapsed[..., 0]  # rank 2 of D = 3 in every sub-batch
    with pytest.raises(WhiteningError, match=r"whitening_eps is 0\. .*--model.whitening_eps 1e-4"):
        WMSELoss(whitening_size=4)(collapsed, perms)
    assert torch.isfinite(WMSELoss(whitening_size=4, eps=1e-4)(collapsed, perms))
