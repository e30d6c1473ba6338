"""Sinkhorn-Knopp: the SwAV paper's Algorithm 1 as reference, marginals, invariances.

The 2-process check (distributed == single process on the concatenated scores) is in
test_multicrop_methods_ddp.py, which spawns once for all DINO/SwAV distributed checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_lightning.losses import sinkhorn_knopp


def sinkhorn_reference(scores: np.ndarray, eps: float = 0.05, niters: int = 3) -> np.ndarray:
    """SwAV (Caron et al., 2020) Algorithm 1 pseudocode, float64, written with explicit r, c."""
    q = np.exp(scores.astype(np.float64) / eps).T
    q /= q.sum()
    k, b = q.shape
    r, c = np.ones(k) / k, np.ones(b) / b
    for _ in range(niters):
        u = q.sum(axis=1)
        q *= (r / u)[:, None]
        q *= (c / q.sum(axis=0))[None, :]
    return (q / q.sum(axis=0, keepdims=True)).T


def normalized_scores(b: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(b, 16, generator=g), dim=1)
    c = torch.nn.functional.normalize(torch.randn(k, 16, generator=g), dim=1)
    return z @ c.T


@pytest.mark.parametrize("niters", [1, 3, 10])
def test_matches_paper_pseudocode(niters):
    scores = normalized_scores(12, 7).double()
    codes = sinkhorn_knopp(scores, epsilon=0.05, iterations=niters)
    expected = sinkhorn_reference(scores.numpy(), 0.05, niters)
    np.testing.assert_allclose(codes.numpy(), expected, rtol=1e-10, atol=1e-15)


def test_marginals():
    scores = normalized_scores(24, 6)
    b, k = scores.shape
    codes = sinkhorn_knopp(scores, iterations=3)
    # Columns (samples) are normalised last: each code sums to 1, i.e. 1/B before rescaling.
    torch.testing.assert_close((codes / b).sum(dim=1), torch.full((b,), 1 / b))
    # Rows (prototypes) approach 1/K of the mass with more rounds, exactly in the limit.
    def row_error(q: torch.Tensor) -> float:
        return ((q / b).sum(dim=0) - 1 / k).abs().max().item()

    assert row_error(codes) < row_error(sinkhorn_knopp(scores, iterations=1))
    converged = sinkhorn_knopp(scores, iterations=200)
    torch.testing.assert_close((converged / b).sum(dim=0), torch.full((k,), 1 / k), atol=1e-6,
                               rtol=0)


def test_equipartition_spreads_a_collapsed_batch():
    # Every sample prefers prototype 0; the equipartition constraint still spreads the codes.
    scores = torch.full((8, 4), -0.5)
    scores[:, 0] = 1.0
    scores += 0.01 * torch.arange(32.0).reshape(8, 4).sin()
    codes = sinkhorn_knopp(scores, epsilon=0.05, iterations=50)
    torch.testing.assert_close(codes.sum(dim=0), torch.full((4,), 2.0), atol=1e-3, rtol=0)


def test_permutation_equivariance_and_shift_invariance():
    scores = normalized_scores(10, 5, seed=3)
    codes = sinkhorn_knopp(scores)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sinkhorn_knopp(scores[perm]), codes[perm])
    torch.testing.assert_close(sinkhorn_knopp(scores + 0.7), codes)


def test_small_epsilon_stays_finite():
    scores = normalized_scores(10, 5) * 1.0
    codes = sinkhorn_knopp(scores, epsilon=0.005, iterations=3)  # exp(200) overflows fp32
    assert torch.isfinite(codes).all()
    torch.testing.assert_close(codes.sum(dim=1), torch.ones(10))


def test_bf16_scores_under_autocast_match_fp32():
    scores = normalized_scores(16, 8).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes = sinkhorn_knopp(scores)
    assert codes.dtype == torch.float32
    # Same (bf16-rounded) inputs in fp32: the computation itself runs in fp32.
    torch.testing.assert_close(codes, sinkhorn_knopp(scores.float()), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs", [dict(epsilon=0.0), dict(iterations=0)])
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        sinkhorn_knopp(torch.zeros(2, 2), **kwargs)
