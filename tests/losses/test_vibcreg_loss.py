"""VIbCReg's loss equals a float64 loop of its terms (MSE invariance, the summed variance hinge,
the normalised covariance 1/D² Σ_{i≠j} C_ij² of the centred, column-normalised embeddings), and
IterNorm equals a per-group loop of Huang et al.'s Algorithm 1 (Newton–Schulz), whitens to the
identity covariance with enough iterations, keeps running statistics for evaluation, and
refuses bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.heads import IterNorm
from ssl_lightning.losses import VIbCRegLoss


def _column(z: torch.Tensor, j: int) -> list[float]:
    return [float(z[n, j]) for n in range(z.shape[0])]


def _variance_loop(z: torch.Tensor) -> float:
    n, d = z.shape
    total = 0.0
    for j in range(d):
        col = _column(z, j)
        mean = sum(col) / n
        var = sum((x - mean) ** 2 for x in col) / (n - 1)
        total += max(0.0, 1 - math.sqrt(var + 1e-4))
    return total / d


def _covariance_loop(z: torch.Tensor) -> float:
    n, d = z.shape
    cols = []
    for j in range(d):
        col = _column(z, j)
        mean = sum(col) / n
        centred = [x - mean for x in col]
        norm = math.sqrt(sum(x * x for x in centred))
        cols.append([x / norm for x in centred])
    total = sum(sum(a * b for a, b in zip(cols[i], cols[j], strict=True)) ** 2
                for i in range(d) for j in range(d) if i != j)
    return total / d**2


def test_vibcreg_loss_equals_the_loop() -> None:
    g = torch.Generator().manual_seed(0)
    z1 = torch.randn(9, 4, generator=g, dtype=torch.float64) * 0.7
    z2 = z1 + 0.3 * torch.randn(9, 4, generator=g, dtype=torch.float64)
    loss = VIbCRegLoss(25.0, 25.0, 200.0)
    invariance = sum((float(a) - float(b)) ** 2 for a, b in zip(z1.flatten(), z2.flatten(),
                                                               strict=True)) / z1.numel()
    variance = _variance_loop(z1) + _variance_loop(z2)
    covariance = _covariance_loop(z1) + _covariance_loop(z2)
    terms = loss.terms(z1, z2)
    for got, want in zip(terms, (invariance, variance, covariance), strict=True):
        assert abs(float(got) - want) < 1e-12
    expected = 25 * invariance + 25 * variance + 200 * covariance
    assert abs(float(loss(z1, z2)) - expected) < 1e-10
    # Unlike VICReg's, the covariance term does not grow with the feature scale.
    assert abs(float(loss.terms(3 * z1, 0.5 * z2)[2]) - covariance) < 1e-12


def _iternorm_loop(x: torch.Tensor, groups: int, iterations: int, eps: float) -> torch.Tensor:
    """Algorithm 1 of Huang et al. (2019), one group at a time, columns as samples."""
    n, f = x.shape
    c = f // groups
    out = torch.empty_like(x)
    for g in range(groups):
        xg = x[:, g * c:(g + 1) * c].T  # (c, n)
        mu = xg.mean(dim=1, keepdim=True)
        xc = xg - mu
        sigma = eps * torch.eye(c, dtype=x.dtype) + xc @ xc.T / n
        trace = float(sum(sigma[i, i] for i in range(c)))
        sigma_n = sigma / trace
        p = torch.eye(c, dtype=x.dtype)
        for _ in range(iterations):
            p = 0.5 * (3 * p - p @ p @ p @ sigma_n)
        out[:, g * c:(g + 1) * c] = (p / math.sqrt(trace) @ xc).T
    return out


def test_iternorm_equals_the_loop_and_whitens() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g, dtype=torch.float64) @ torch.randn(
        6, 6, generator=g, dtype=torch.float64) + 2.0
    norm = IterNorm(6, num_groups=2, iterations=5).double()
    torch.testing.assert_close(norm(x), _iternorm_loop(x, 2, 5, 1e-5), rtol=0, atol=1e-12)
    # 10 iterations reach 8.6e-9 here (T = 5: 0.27, the paper's deliberately partial whitening;
    # this uncoupled Newton form loses commutativity by rounding and diverges past ~20).
    exact = IterNorm(6, num_groups=1, iterations=10, eps=1e-12).double()
    z = exact(x)
    torch.testing.assert_close(z.T @ z / 64, torch.eye(6, dtype=torch.float64), rtol=0,
                               atol=1e-6)


def test_iternorm_running_statistics_drive_evaluation() -> None:
    x = torch.randn(32, 4, dtype=torch.float64) * 3 + 1
    norm = IterNorm(4, num_groups=2, momentum=1.0).double()
    train_out = norm(x)
    assert {"running_mean", "running_whitening"} <= set(norm.state_dict())
    norm.eval()
    torch.testing.assert_close(norm(x), train_out, rtol=0, atol=1e-12)  # momentum 1: same


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_groups=3 must be >= 1 and divide num_features=8"):
        IterNorm(8, num_groups=3)
    with pytest.raises(ValueError, match="iterations must be >= 1, got 0"):
        IterNorm(8, 2, iterations=0)
    with pytest.raises(ValueError, match=r"momentum must be in \(0, 1\], got 0"):
        IterNorm(8, 2, momentum=0)
    with pytest.raises(ValueError, match="covariance_weight must be >= 0, got -1"):
        VIbCRegLoss(covariance_weight=-1)
