"""Barlow Twins: the loss against a loop reference of the paper's
formula, invariance to per-feature affine maps, fp32 under bf16 autocast, exact resume."""

import math

import numpy as np
import pytest
import torch
from loss_references import assert_computes_in_fp32_under_bf16

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import BarlowTwinsLoss
from ssl_lightning.methods import BarlowTwins


def barlow_twins_reference(z1: np.ndarray, z2: np.ndarray, lam: float, eps: float = 1e-5):
    """Zbontar et al. 2021, Eqs. (1)-(2): batch-normalise each dimension (biased variance),
    C_ij = sum_b z1n_bi z2n_bj / N, L = sum_i (1 - C_ii)^2 + lam sum_{i != j} C_ij^2."""
    n, d = z1.shape

    def normalise(z):
        out = np.empty_like(z)
        for j in range(d):
            mean = sum(z[b, j] for b in range(n)) / n
            var = sum((z[b, j] - mean) ** 2 for b in range(n)) / n
            for b in range(n):
                out[b, j] = (z[b, j] - mean) / math.sqrt(var + eps)
        return out

    a, b_ = normalise(z1), normalise(z2)
    loss = 0.0
    for i in range(d):
        for j in range(d):
            c = sum(a[k, i] * b_[k, j] for k in range(n)) / n
            loss += (1 - c) ** 2 if i == j else lam * c**2
    return loss


def _embeddings(n=10, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, generator=g, dtype=torch.float64) * 2 + 1
    return z1, z1 + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("lam", [0.0051, 0.5])
def test_loss_matches_loop_reference(lam):
    z1, z2 = _embeddings()
    loss = BarlowTwinsLoss(lam)(z1, z2)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - barlow_twins_reference(z1.numpy(), z2.numpy(), lam)) < 1e-10


def test_lambda_none_is_one_over_dimension():
    z1, z2 = _embeddings(d=6)
    torch.testing.assert_close(BarlowTwinsLoss(None)(z1, z2), BarlowTwinsLoss(1 / 6)(z1, z2),
                               rtol=0, atol=1e-12)


def test_invariant_to_per_feature_affine_maps_of_the_inputs():
    z1, z2 = _embeddings(n=32, d=5)
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor([0.3, -2.0, 5.0, 1.0, -0.7], dtype=torch.float64)  # signs shared
    shift1, shift2 = torch.randn(2, 5, generator=g, dtype=torch.float64) * 10
    scale2 = scale * torch.tensor([2.0, 0.5, 3.0, 0.1, 1.5], dtype=torch.float64)  # > 0 ratio
    exact = BarlowTwinsLoss(eps=0.0)
    torch.testing.assert_close(exact(scale * z1 + shift1, scale2 * z2 + shift2), exact(z1, z2),
                               rtol=1e-12, atol=0)
    # With BatchNorm's eps = 1e-5 it holds up to the eps/var perturbation (var >= 0.3 here).
    default = BarlowTwinsLoss()
    torch.testing.assert_close(default(scale * z1 + shift1, scale * z2 + shift2),
                               default(z1, z2), rtol=0, atol=1e-5)
    # Not a trivial property: a per-sample (row) rescaling does change the loss.
    rows = torch.linspace(0.5, 2.0, 32, dtype=torch.float64).unsqueeze(1)
    assert (exact(rows * z1, z2) - exact(z1, z2)).abs() > 1e-3


def test_identical_decorrelated_views_give_zero_loss():
    signs = torch.tensor([[1, 1], [1, -1], [-1, 1], [-1, -1]], dtype=torch.float64)
    z = signs.repeat(4, 1)  # per-dimension mean 0, variance 1, uncorrelated
    assert BarlowTwinsLoss(eps=0.0)(z, z).abs() < 1e-12


def test_rejects_bad_hyperparameters_and_shapes():
    with pytest.raises(ValueError, match="lambda_offdiag"):
        BarlowTwinsLoss(-0.1)
    with pytest.raises(ValueError, match="eps"):
        BarlowTwinsLoss(eps=-1.0)
    with pytest.raises(ValueError, match="equal shape"):
        BarlowTwinsLoss()(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=">= 2"):
        BarlowTwinsLoss()(torch.zeros(1, 3), torch.zeros(1, 3))


def test_bf16_autocast_computes_in_fp32():
    # Against the all-fp32 forward, only the bf16 rounding of z differs (< 2%).
    assert_computes_in_fp32_under_bf16(BarlowTwinsLoss(), rtol=2e-2, atol=0)


def _model() -> BarlowTwins:
    return BarlowTwins(SmallConvNet(widths=(8, 16), norm="group"), projection_hidden_dim=16,
                       projection_dim=16, optimizer="lars", lr=0.3, weight_decay=1e-4,
                       warmup_epochs=1)
