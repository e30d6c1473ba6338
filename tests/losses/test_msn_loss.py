"""MSNLoss equals a float64 numpy reference written from the MSN paper (Assran et al., ECCV 2022,
Eq. 1-2 and the official code's loss: sharpening ``p^{1/T}``, the ``distributed_sinkhorn`` rounds
on the sharpened probabilities, the cross-entropy over all anchor views, me-max ``log K − H(p̄)``)
and the PMSN paper (ICLR 2023: ``KL(p̄ ‖ π)``, ``π_k ∝ k^{−s}``). Properties: PMSN with s = 0
is MSN; the regulariser is 0 at the prior; gradients match finite differences; bad settings
are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_lightning.losses import MSNLoss


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def msn_reference(anchors: np.ndarray, targets: np.ndarray, prototypes: np.ndarray, tau: float,
                  sharpen: float, iterations: int, weight: float, exponent: float) -> float:
    """The loss from the papers' formulas, loops over anchors (float64)."""
    batch, views, _ = anchors.shape
    k = prototypes.shape[0]
    q = _unit(prototypes)
    p_target = _softmax(_unit(targets) @ q.T / tau)
    p_plus = p_target ** (1 / sharpen)
    p_plus /= p_plus.sum(axis=1, keepdims=True)
    if iterations:
        m = p_plus.T / p_plus.sum()  # (K, B)
        for _ in range(iterations):
            m /= m.sum(axis=1, keepdims=True) * k
            m /= m.sum(axis=0, keepdims=True) * batch
        p_plus = (m * batch).T
    cross_entropy, mean = 0.0, np.zeros(k)
    for i in range(batch):
        for v in range(views):
            p = _softmax(_unit(anchors[i, v]) @ q.T / tau)
            cross_entropy -= float((p_plus[i] * np.log(p)).sum())
            mean += p
    cross_entropy /= batch * views
    mean /= batch * views
    prior = np.arange(1, k + 1, dtype=np.float64) ** -exponent
    prior /= prior.sum()
    return cross_entropy + weight * float((mean * np.log(mean / prior)).sum())


def _inputs(batch: int = 6, views: int = 3, dim: int = 5, k: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, views, dim, generator=g, dtype=torch.float64),
            torch.randn(batch, dim, generator=g, dtype=torch.float64),
            torch.randn(k, dim, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("iterations", [0, 1, 3])
@pytest.mark.parametrize("exponent, weight", [(0.0, 1.0), (0.25, 1.0), (0.5, 0.3)])
def test_matches_the_papers_formula_in_float64(iterations: int, exponent: float,
                                               weight: float) -> None:
    anchors, targets, prototypes = _inputs()
    loss = MSNLoss(0.1, 0.25, iterations, weight, exponent)(anchors, targets, prototypes)
    expected = msn_reference(anchors.numpy(), targets.numpy(), prototypes.numpy(), 0.1, 0.25,
                             iterations, weight, exponent)
    assert loss.dtype == torch.float64
    assert abs(float(loss) - expected) < 1e-12 * max(1.0, abs(expected))


def test_uniform_prior_is_me_max_and_pmsn_with_exponent_zero() -> None:
    anchors, targets, prototypes = _inputs(seed=1)
    msn = MSNLoss(power_law_exponent=0.0)
    _, regularizer = msn.terms(anchors, targets, prototypes)
    q = torch.nn.functional.normalize(prototypes, dim=-1)
    p = torch.softmax(torch.nn.functional.normalize(anchors, dim=-1) @ q.T / 0.1, dim=-1)
    mean = p.flatten(0, 1).mean(0)
    entropy = -(mean * mean.log()).sum()
    torch.testing.assert_close(regularizer, math.log(7) - entropy, rtol=1e-12, atol=1e-14)
    pmsn_loss = MSNLoss(power_law_exponent=0.25)(anchors, targets, prototypes)
    assert abs(float(pmsn_loss - msn(anchors, targets, prototypes))) > 1e-3  # the prior bites


def test_regularizer_vanishes_at_the_prior() -> None:
    """Identical prototypes: every prediction is uniform, so KL(p̄ ‖ uniform) = 0 and the power
    law's KL(uniform ‖ π) has its closed form."""
    anchors, targets, _ = _inputs(seed=2)
    prototypes = torch.ones(7, 5, dtype=torch.float64)
    _, me_max = MSNLoss(power_law_exponent=0.0).terms(anchors, targets, prototypes)
    assert abs(float(me_max)) < 1e-14
    _, power = MSNLoss(power_law_exponent=0.25).terms(anchors, targets, prototypes)
    prior = torch.arange(1, 8, dtype=torch.float64) ** -0.25
    prior /= prior.sum()
    expected = (1 / 7 * (1 / 7 / prior).log()).sum()
    torch.testing.assert_close(power, expected, rtol=1e-12, atol=0)


def test_anchor_gradients_match_finite_differences() -> None:
    """(The prototypes' finite differences would also move the no-grad targets.)"""
    anchors, targets, prototypes = _inputs(batch=3, views=2, dim=3, k=4, seed=3)
    loss = MSNLoss(0.1, 0.25, 3, 1.0, 0.25)
    assert torch.autograd.gradcheck(lambda a: loss(a, targets, prototypes),
                                    (anchors.requires_grad_(),))


def test_targets_carry_no_gradient() -> None:
    anchors, targets, prototypes = _inputs(seed=4)
    targets.requires_grad_()
    MSNLoss()(anchors.requires_grad_(), targets, prototypes).backward()
    assert targets.grad is None and anchors.grad is not None


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0}, "temperature"), ({"sharpen_temperature": 1.5}, "sharpen"),
    ({"sinkhorn_iterations": -1}, "sinkhorn"), ({"regularization_weight": -1.0}, "weight"),
    ({"power_law_exponent": -0.1}, "exponent")])
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MSNLoss(**kwargs)


def test_bad_shapes_are_refused() -> None:
    anchors, targets, prototypes = _inputs()
    with pytest.raises(ValueError, match=r"\(B, M, D\)"):
        MSNLoss()(anchors[:, 0], targets, prototypes)
    with pytest.raises(ValueError, match="prototypes"):
        MSNLoss()(anchors, targets, prototypes[:, :3])
