"""SIGReg and the LeJEPA loss equal float64 loops written from the paper's equations
(Balestriero & LeCun 2025, arXiv 2511.08544): the Epps–Pulley statistic with the complex
empirical characteristic function, integrated by the trapezoid rule on the full grid [−3, 3];
the invariance term as a loop over samples, views and the centre of the global views.
Properties: SIGReg is near 0 for Gaussian samples and large for collapsed ones; the directions
are unit vectors fixed by the seed; bad settings are refused."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses import LeJEPALoss, SIGRegLoss
from ssl_lightning.losses.sigreg import sigreg_directions


def _epps_pulley_reference(x: list[float], t_max: float = 3.0, knots: int = 33) -> float:
    """N ∫_{−t_max}^{t_max} |φ_N(t) − e^{−t²/2}|² e^{−t²/2} dt, trapezoid on a full grid."""
    n = len(x)
    grid = [-t_max + 2 * t_max * k / (knots - 1) for k in range(knots)]
    values = []
    for t in grid:
        ecf = sum(complex(math.cos(t * v), math.sin(t * v)) for v in x) / n
        values.append(abs(ecf - math.exp(-t * t / 2)) ** 2 * math.exp(-t * t / 2))
    dt = grid[1] - grid[0]
    return n * dt * (sum(values) - (values[0] + values[-1]) / 2)


def _sigreg_reference(z: torch.Tensor, directions: torch.Tensor) -> float:
    """Mean over views and directions of the Epps–Pulley statistic of zᵀa."""
    stats = []
    for v in range(z.shape[1]):
        for m in range(directions.shape[1]):
            projected = [sum(float(z[b, v, d]) * float(directions[d, m])
                             for d in range(z.shape[2])) for b in range(z.shape[0])]
            stats.append(_epps_pulley_reference(projected))
    return sum(stats) / len(stats)


def _invariance_reference(z: torch.Tensor, num_global: int) -> float:
    batch, views, dim = z.shape
    total = 0.0
    for b in range(batch):
        centre = [sum(float(z[b, g, d]) for g in range(num_global)) / num_global
                  for d in range(dim)]
        total += sum((centre[d] - float(z[b, v, d])) ** 2 for v in range(views)
                     for d in range(dim))
    return total / (batch * views * dim)


def _data(batch: int = 7, views: int = 4, dim: int = 5, slices: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, views, dim, generator=g, dtype=torch.float64) * 1.3 + 0.2
    return z, sigreg_directions(dim, slices, g, dtype=torch.float64)


def test_sigreg_equals_the_epps_pulley_loop() -> None:
    z, directions = _data()
    got = SIGRegLoss(num_slices=3)(z, directions)
    assert got.dtype == torch.float64
    assert abs(float(got) - _sigreg_reference(z, directions)) < 1e-10
    two_dim = SIGRegLoss(num_slices=3)(z[:, 0], directions)  # (B, D): one view
    assert abs(float(two_dim) - _sigreg_reference(z[:, :1], directions)) < 1e-10


def test_lejepa_loss_equals_the_loop() -> None:
    z, directions = _data()
    loss = LeJEPALoss(lambda_sigreg=0.05, num_global_views=2, num_slices=3)
    sigreg, invariance = loss.terms(z, directions)
    assert abs(float(invariance) - _invariance_reference(z, 2)) < 1e-12
    expected = 0.05 * _sigreg_reference(z, directions) + 0.95 * _invariance_reference(z, 2)
    assert abs(float(loss(z, directions)) - expected) < 1e-10


def test_sigreg_is_small_for_gaussians_and_large_for_collapse() -> None:
    g = torch.Generator().manual_seed(1)
    gaussian = torch.randn(4096, 8, generator=g, dtype=torch.float64)
    directions = sigreg_directions(8, 64, g, dtype=torch.float64)
    loss = SIGRegLoss(num_slices=64)
    # For N(0, 1) samples N·E|φ_N − φ|² = 1 − e^{−t²}, so E[EP] = ∫ (1 − e^{−t²}) e^{−t²/2} dt
    # = √(2π) − √(2π/3) ≈ 1.06 on the whole line (1.05 measured here).
    assert 0.8 < float(loss(gaussian, directions)) < 1.3
    assert float(loss(3 * gaussian, directions)) > 1000.0  # the wrong scale is seen
    collapsed = torch.ones(4096, 8, dtype=torch.float64)
    assert float(loss(collapsed, directions)) > 100.0


def test_directions_are_unit_vectors_fixed_by_the_seed() -> None:
    a = sigreg_directions(6, 10, torch.Generator().manual_seed(3))
    b = sigreg_directions(6, 10, torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(a.norm(dim=0), torch.ones(10))
    torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-7)
    assert not torch.equal(a, sigreg_directions(6, 10, torch.Generator().manual_seed(4)))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="lambda_sigreg must be in \\[0, 1\\], got 1.5"):
        LeJEPALoss(lambda_sigreg=1.5)
    with pytest.raises(ValueError, match="num_slices must be >= 1, got 0"):
        SIGRegLoss(num_slices=0)
    with pytest.raises(ValueError, match="knots must be >= 2, got 1"):
        SIGRegLoss(knots=1)
    with pytest.raises(ValueError, match="t_max must be > 0, got 0"):
        SIGRegLoss(t_max=0)
    z, directions = _data(views=1)
    with pytest.raises(ValueError, match="V >= 2 views"):
        LeJEPALoss(num_slices=3)(z, directions)
