"""VICReg: the loss against a loop reference of the paper's formulas,
its closed-form properties, fp32 under bf16 autocast, exact resume, and a Lightning DDP
fit equal to one process with the global batch (through Lightning's all_gather)."""

import math

import numpy as np
import pytest
import torch
from loss_references import assert_computes_in_fp32_under_bf16
from torch.utils.data import Subset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import VICRegLoss
from ssl_lightning.methods import VICReg
from ssl_lightning.testing.trainer_runs import (
    PrecomputedViews,
    TensorDataModule,
    assert_states_close,
    ddp_global_order,
    fit_and_dump,
)


def vicreg_reference(z1: np.ndarray, z2: np.ndarray, lam=25.0, mu=25.0, nu=1.0, eps=1e-4):
    """Bardes et al. 2022, Eqs. (1)-(6) with Algorithm 1's halved variance sum, as loops."""
    n, d = z1.shape
    invariance = sum((z1[i, j] - z2[i, j]) ** 2 for i in range(n) for j in range(d)) / (n * d)

    def variance(z):
        total = 0.0
        for j in range(d):
            mean = sum(z[k, j] for k in range(n)) / n
            var = sum((z[k, j] - mean) ** 2 for k in range(n)) / (n - 1)
            total += max(0.0, 1.0 - math.sqrt(var + eps))
        return total / d

    def covariance(z):
        means = [sum(z[k, j] for k in range(n)) / n for j in range(d)]
        total = 0.0
        for a in range(d):
            for b in range(d):
                if a != b:
                    cov = sum((z[k, a] - means[a]) * (z[k, b] - means[b]) for k in range(n))
                    total += (cov / (n - 1)) ** 2
        return total / d

    return (lam * invariance + mu * (variance(z1) + variance(z2)) / 2
            + nu * (covariance(z1) + covariance(z2)))


def _embeddings(n=12, d=5, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, generator=g, dtype=torch.float64) * scale
    return z1, z1 + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("weights", [(25.0, 25.0, 1.0), (1.0, 3.0, 0.5)])
def test_loss_matches_loop_reference(weights):
    z1, z2 = _embeddings()
    loss = VICRegLoss(*weights)(z1, z2)
    expected = vicreg_reference(z1.numpy(), z2.numpy(), *weights)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected) < 1e-10
    # Every term is active: the variance hinge (std 0.5 < 1) and the covariance.
    inv, var, cov = VICRegLoss().terms(z1, z2)
    assert inv > 0 and var > 0.1 and cov > 0


def test_gathered_batch_gives_the_global_statistics():
    z1, z2 = _embeddings(n=12)
    local = VICRegLoss().terms(z1[:6], z2[:6], z1, z2)
    full = VICRegLoss().terms(z1, z2)
    # Variance and covariance come from the gathered batch; invariance from the local pairs.
    torch.testing.assert_close(local[1:], full[1:], rtol=0, atol=1e-12)
    torch.testing.assert_close(local[0], ((z1[:6] - z2[:6]) ** 2).mean(), rtol=0, atol=1e-12)


def test_variance_term_is_zero_when_every_std_is_at_least_one():
    z1, z2 = _embeddings(n=64, scale=1.0)
    z1 = (z1 - z1.mean(0)) / z1.std(0)  # every std exactly 1: sqrt(1 + eps) > 1
    z2 = 3.0 * z2 / z2.std(0)
    assert VICRegLoss().terms(z1, z2)[1] == 0
    shrunk = VICRegLoss().terms(0.5 * z1, z2)[1]  # std 0.5 in view 1: hinge mean 0.5, halved
    assert abs(shrunk.item() - (1 - math.sqrt(0.25 + 1e-4)) / 2) < 1e-12


def test_covariance_term_is_zero_for_uncorrelated_dimensions_and_invariance_for_equal_views():
    q, _ = torch.linalg.qr(torch.randn(16, 4, dtype=torch.float64))
    z = q - q.mean(0)  # not exactly orthogonal after centring; re-orthogonalise
    z, _ = torch.linalg.qr(z)
    z = z - z.mean(0)
    inv, _, cov = VICRegLoss().terms(z, z)
    assert inv == 0
    assert cov < 1e-20


def test_rejects_bad_hyperparameters_and_shapes():
    with pytest.raises(ValueError, match="variance_weight"):
        VICRegLoss(variance_weight=-1.0)
    with pytest.raises(ValueError, match="eps"):
        VICRegLoss(eps=0.0)
    with pytest.raises(ValueError, match="equal shape"):
        VICRegLoss()(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="at least 2"):
        VICRegLoss()(torch.zeros(1, 3), torch.zeros(1, 3))


def test_bf16_autocast_computes_in_fp32():
    # Against the all-fp32 forward the only difference is bf16 rounding of z (< 2%).
    assert_computes_in_fp32_under_bf16(VICRegLoss(), rtol=2e-2, atol=0)


def _model() -> VICReg:
    return VICReg(SmallConvNet(widths=(8, 16), norm="group"), expander_hidden_dim=16,
                  expander_dim=16, optimizer="lars", lr=0.3, weight_decay=1e-4,
                  warmup_epochs=1, lr_scaling="linear")


def test_fit_logs_the_three_terms():
    state = fit_and_dump(_model(), TensorDataModule(PrecomputedViews(8), 4), max_steps=2)[0]
    for name in ("invariance", "variance", "covariance"):
        assert math.isfinite(state["metrics"][f"train/vicreg_{name}"])


def _bn_free_model() -> VICReg:
    torch.manual_seed(0)
    return VICReg(SmallConvNet(widths=(8, 16), norm="group"), expander_hidden_dim=16,
                  expander_dim=16, head_batch_norm=False, optimizer="sgd", lr=0.5,
                  weight_decay=1e-4, warmup_epochs=0)


@pytest.mark.slow
def test_lightning_ddp_fit_equals_single_process_with_the_global_batch():
    """End to end through Lightning's all_gather (DDP on 2 CPU processes, 3 steps)."""
    data = PrecomputedViews(24)
    ddp = fit_and_dump(_bn_free_model(), TensorDataModule(data, 4), devices=2, max_steps=3)
    single = fit_and_dump(_bn_free_model(), TensorDataModule(
        Subset(data, ddp_global_order(24, 2, 4)), 8), devices=1, max_steps=3)
    initial = _bn_free_model().state_dict()
    assert max((single[0]["model"][k] - initial[k]).abs().max() for k in initial) > 1e-2
    for rank_state in ddp:
        assert_states_close(rank_state["model"], single[0]["model"], atol=1e-6)
        assert_states_close(rank_state["optimizer"], single[0]["optimizer"], atol=1e-6)
