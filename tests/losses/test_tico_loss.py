"""TiCo's loss equals a float64 loop of the paper's Eq. (5) / Algorithm 1 over 3 steps (the
running covariance carried from step to step), the covariance is updated from the gathered
batch and only in training mode, and bad settings are refused."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning.losses import TiCoLoss


def _normalised(row: list[float]) -> list[float]:
    norm = sum(v * v for v in row) ** 0.5
    return [v / norm for v in row]


def _tico_reference(z_a, z_b, z_all, cov, beta, rho):  # type: ignore[no-untyped-def]
    """Loss and new covariance, as loops: C_t = β C + (1 − β) 1/N Σ z zᵀ, then
    1 − mean⟨z_a, z_b⟩ + ρ · mean z_aᵀ C_t z_a."""
    a = [_normalised(r) for r in z_a.tolist()]
    b = [_normalised(r) for r in z_b.tolist()]
    every = [_normalised(r) for r in z_all.tolist()]
    dim = len(a[0])
    new = [[beta * cov[i][j] + (1 - beta) * sum(z[i] * z[j] for z in every) / len(every)
            for j in range(dim)] for i in range(dim)]
    invariance = 1 - sum(sum(x * y for x, y in zip(p, q, strict=True))
                         for p, q in zip(a, b, strict=True)) / len(a)
    contrast = sum(sum(z[i] * new[i][j] * z[j] for i in range(dim) for j in range(dim))
                   for z in a) / len(a)
    return invariance + rho * contrast, new


def test_tico_loss_equals_the_loop_over_steps() -> None:
    g = torch.Generator().manual_seed(0)
    loss = TiCoLoss(5, beta=0.7, rho=3.0).double()
    cov = [[0.0] * 5 for _ in range(5)]
    for _ in range(3):
        z_all = torch.randn(8, 5, generator=g, dtype=torch.float64)
        z_a, z_b = z_all[2:5], torch.randn(3, 5, generator=g, dtype=torch.float64)
        expected, cov = _tico_reference(z_a, z_b, z_all, cov, 0.7, 3.0)
        got = loss(z_a, z_b, z_all)
        assert abs(float(got) - expected) < 1e-12
        torch.testing.assert_close(loss.covariance, torch.tensor(cov, dtype=torch.float64),
                                   rtol=0, atol=1e-14)


def test_covariance_is_a_persistent_buffer_updated_only_in_training() -> None:
    loss = TiCoLoss(4)
    assert "covariance" in loss.state_dict()
    z = torch.randn(6, 4)
    loss.eval()
    loss(z, z)
    assert not loss.covariance.any()
    loss.train()
    value = loss(z, z)
    assert loss.covariance.any() and value.requires_grad is False  # no parameters, no grad
    z = torch.randn(6, 4, requires_grad=True)
    loss(z, torch.randn(6, 4)).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\), got 1.0"):
        TiCoLoss(4, beta=1.0)
    with pytest.raises(ValueError, match="rho must be >= 0, got -1"):
        TiCoLoss(4, rho=-1)
    with pytest.raises(ValueError, match=r"expects two \(B, 4\) tensors"):
        TiCoLoss(4)(torch.randn(3, 5), torch.randn(3, 5))
