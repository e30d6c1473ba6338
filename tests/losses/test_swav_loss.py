"""SwAV swapped-prediction loss vs the paper's pseudocode (float64), queue, gradients, autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sinkhorn import normalized_scores, sinkhorn_reference

from ssl_lightning.losses import SwAVLoss


def log_softmax_np(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def swav_reference(scores, assign=(0, 1), tau=0.1, eps=0.05, niters=3, queue=None):
    """Caron et al. 2020, Algorithm 1 generalised to multi-crop (§3.2): for each assigned crop i,
    q_i = sinkhorn(scores_i) (queue rows prepended, then dropped); loss = mean over i and over the
    other crops v of −mean_b Σ_k q_i log softmax(scores_v / τ)."""
    total, terms = 0.0, 0
    for n, i in enumerate(assign):
        inp = scores[i] if queue is None else np.concatenate([queue[n], scores[i]])
        q = sinkhorn_reference(inp, eps, niters)[-scores[i].shape[0]:]
        for v in range(len(scores)):
            if v == i:
                continue
            total += -np.mean(np.sum(q * log_softmax_np(scores[v] / tau), axis=1))
            terms += 1
    return total / terms


def crop_scores(n_crops=4, b=8, k=5):
    """float64: the comparisons with the float64 references are exact to 1e-10."""
    return [normalized_scores(b, k, seed=s).double() for s in range(n_crops)]


def test_multicrop_loss_matches_reference():
    scores = crop_scores()
    loss = SwAVLoss(temperature=0.1, epsilon=0.05, sinkhorn_iterations=3)(scores)
    expected = swav_reference([s.double().numpy() for s in scores])
    assert loss.item() == pytest.approx(expected, rel=1e-10)


def test_two_crop_loss_is_algorithm_1():
    scores = crop_scores(n_crops=2)
    q1, q2 = (torch.from_numpy(sinkhorn_reference(s.numpy())) for s in scores)
    p1, p2 = (torch.log_softmax(s / 0.1, dim=1) for s in scores)
    expected = -0.5 * ((q1 * p2).sum(1).mean() + (q2 * p1).sum(1).mean())
    torch.testing.assert_close(SwAVLoss()(scores), expected, rtol=1e-10, atol=0)


def test_queue_scores_join_sinkhorn_but_not_the_loss():
    scores = crop_scores(n_crops=3, b=4)
    queue = [normalized_scores(12, 5, seed=10 + i).double() for i in range(2)]
    loss = SwAVLoss()(scores, queue)
    expected = swav_reference([s.double().numpy() for s in scores],
                              queue=[q.double().numpy() for q in queue])
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert abs(loss.item() - SwAVLoss()(scores).item()) > 1e-4


def test_gradients_match_float64_autograd_reference():
    scores = [s.double().requires_grad_() for s in crop_scores()]
    codes = [torch.from_numpy(sinkhorn_reference(scores[i].detach().numpy())) for i in (0, 1)]
    reference = sum(
        -(codes[n] * torch.log_softmax(scores[v] / 0.1, dim=1)).sum(1).mean()
        for n, i in enumerate((0, 1)) for v in range(4) if v != i
    ) / 6
    expected = torch.autograd.grad(reference, scores)
    inputs = [s.detach().clone().requires_grad_() for s in scores]
    SwAVLoss()(inputs).backward()
    for got, want in zip(inputs, expected, strict=True):
        torch.testing.assert_close(got.grad, want, rtol=1e-10, atol=1e-13)


def test_bf16_inputs_under_autocast_computed_in_fp32():
    scores = [s.float().bfloat16() for s in crop_scores(k=32)]
    reference = SwAVLoss()([s.float() for s in scores])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = SwAVLoss()(scores)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=0.0), dict(epsilon=-1.0), dict(sinkhorn_iterations=0),
     dict(crops_for_assign=())],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        SwAVLoss(**kwargs)


def test_invalid_call():
    with pytest.raises(ValueError, match="assigned crops"):
        SwAVLoss(crops_for_assign=(0, 3))(crop_scores(n_crops=3))
    with pytest.raises(ValueError, match="queue_scores"):
        SwAVLoss()(crop_scores(), [torch.zeros(4, 5)])
