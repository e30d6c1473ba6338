"""MMCR's loss equals a float64 loop of the paper's Eq. (4): centroids of the unit-normalised
views as loops, nuclear norms as the sum of the square roots of the eigenvalues of the smaller
Gram matrix (an algorithm other than the loss's SVD; the smaller one has no zero eigenvalue,
whose rounding-level square root would cost 1e-8). Closed forms: identical views give
||Z_b||_* = √k, a collapsed batch ||C||_* = √N, orthonormal centroids ||C||_* = N; bad settings
are refused."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses import MMCRLoss


def _nuclear(rows: list[list[float]]) -> float:
    m = torch.tensor(rows, dtype=torch.float64)
    gram = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m  # the smaller one: no zero
    return float(torch.linalg.eigvalsh(gram).clamp(min=0).sqrt().sum())  # eigenvalues


def _mmcr_reference(z: torch.Tensor, lam: float) -> float:
    batch, k, dim = z.shape
    cents, views_term = [], 0.0
    for b in range(batch):
        unit = []
        for v in range(k):
            norm = math.sqrt(sum(float(z[b, v, d]) ** 2 for d in range(dim)))
            unit.append([float(z[b, v, d]) / norm for d in range(dim)])
        cents.append([sum(u[d] for u in unit) / k for d in range(dim)])
        views_term += _nuclear(unit)
    return -_nuclear(cents) + lam * views_term / batch


def test_mmcr_loss_equals_the_loop() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 3, 5, generator=g, dtype=torch.float64) * 2.0
    for lam in (0.0, 5e-3, 0.7):
        got = MMCRLoss(lam)(z)
        assert got.dtype == torch.float64
        assert abs(float(got) - _mmcr_reference(z, lam)) < 1e-10


def test_closed_forms() -> None:
    eye = torch.eye(4, dtype=torch.float64)
    same_views = eye.unsqueeze(1).expand(4, 3, 4)  # orthonormal centroids, identical views
    assert abs(float(MMCRLoss(1.0)(same_views)) - (-4.0 + math.sqrt(3))) < 1e-12
    collapsed = torch.ones(5, 2, 4, dtype=torch.float64)
    assert abs(float(MMCRLoss(0.0)(collapsed)) + math.sqrt(5)) < 1e-12  # rank 1: √N, not N


def test_gradient_flows_and_bad_settings_are_refused() -> None:
    z = torch.randn(6, 2, 4, dtype=torch.float64, requires_grad=True)
    MMCRLoss()(z).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="lambda_views must be >= 0, got -1"):
        MMCRLoss(-1)
    with pytest.raises(ValueError, match="k >= 2 views"):
        MMCRLoss()(torch.randn(4, 1, 3))
