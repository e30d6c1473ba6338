"""InfoNCE (MoCo v1/v2), the MoCo v3 loss and the key queue against the papers' formulas
and under bfloat16 autocast."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_lightning.losses import InfoNCELoss, MoCoV3Loss
from ssl_lightning.queues import FeatureQueue


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def infonce_reference(q: np.ndarray, k: np.ndarray, neg: np.ndarray, t: float) -> float:
    """MoCo Eq. (1), one query at a time, in float64."""
    q, k, neg = _unit(q), _unit(k), _unit(neg)
    losses = []
    for i in range(len(q)):
        pos = math.exp(float(q[i] @ k[i]) / t)
        negs = sum(math.exp(float(q[i] @ n) / t) for n in neg)
        losses.append(-math.log(pos / (pos + negs)))
    return float(np.mean(losses))


def moco_v3_reference(q: np.ndarray, k_all: np.ndarray, offset: int, t: float) -> float:
    """MoCo v3 Algorithm 1, ctr(q, k) = CE(q k^T / T, own index) * 2T, one query at a time."""
    q, k_all = _unit(q), _unit(k_all)
    losses = []
    for i in range(len(q)):
        logits = [float(q[i] @ k) / t for k in k_all]
        losses.append(-logits[offset + i] + math.log(sum(math.exp(v) for v in logits)))
    return float(np.mean(losses)) * 2 * t


@pytest.mark.parametrize("t", [0.07, 0.2, 1.0])
def test_infonce_matches_reference(t: float) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, neg = (torch.randn(n, 8, generator=g, dtype=torch.float64) * 3 for n in (6, 6, 20))
    loss = InfoNCELoss(t)(q, k, neg)
    assert loss.item() == pytest.approx(infonce_reference(q.numpy(), k.numpy(), neg.numpy(), t),
                                        rel=1e-10)


def test_infonce_properties_and_gradient_only_through_query() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    neg = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    loss = InfoNCELoss(0.2)(q, k, neg)
    loss.backward()
    assert q.grad is not None and k.grad is None and neg.grad is None
    # Scale invariance (inputs are normalised) and the closed form when all logits are equal.
    assert InfoNCELoss(0.2)(5 * q, k, neg).item() == pytest.approx(loss.item(), rel=1e-10)
    ones = torch.ones(3, 8)
    assert InfoNCELoss(0.5)(ones, ones, torch.ones(4, 8)).item() == pytest.approx(math.log(5))


@pytest.mark.parametrize("offset", [0, 4, 8])
def test_moco_v3_loss_matches_reference(offset: int) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 8, generator=g, dtype=torch.float64)
    k_all = torch.randn(12, 8, generator=g, dtype=torch.float64)
    for t in (0.2, 1.0):
        loss = MoCoV3Loss(t)(q, k_all, offset)
        assert loss.item() == pytest.approx(
            moco_v3_reference(q.numpy(), k_all.numpy(), offset, t), rel=1e-10)


def test_moco_v3_loss_checks_offset_and_temperature() -> None:
    with pytest.raises(ValueError, match="-0.1"):
        MoCoV3Loss(-0.1)
    with pytest.raises(ValueError, match="rank_offset 8"):
        MoCoV3Loss()(torch.randn(4, 8), torch.randn(8, 8), rank_offset=8)
    with pytest.raises(ValueError, match="0.0"):
        InfoNCELoss(0.0)


@pytest.mark.parametrize("loss_fn", [
    lambda q, k, n: InfoNCELoss(0.2)(q, k, n),
    lambda q, k, n: MoCoV3Loss(0.2)(q, torch.cat([k, n[:8]]), 0),
])
def test_losses_under_bf16_autocast_match_fp32(loss_fn) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 16, generator=g)
    x, k, n = (torch.randn(m, 16, generator=g) for m in (8, 8, 32))
    reference = loss_fn(x @ w, k, n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(x @ w, k, n)  # the matmul runs in bf16, the loss in fp32
    # fp32 output proves the loss left autocast (a bf16 computation would return bf16); the
    # value differs only by the bf16 rounding of the matmul output (2^-8 relative per element).
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference.item(), rel=5e-3)


def test_queue_fifo_pointer_and_wraparound() -> None:
    queue = FeatureQueue(size=6, dim=3)
    assert torch.allclose(queue.queue.norm(dim=1), torch.ones(6))
    assert torch.equal(queue.queue, FeatureQueue(6, 3).queue)  # same init on every rank
    batches = [torch.full((2, 3), float(i)) for i in range(4)]
    for b in batches:
        queue.enqueue(b)
    # 4 batches of 2 into 6 slots: batch 3 overwrote batch 0's slots.
    assert torch.equal(queue.queue, torch.cat([batches[3], batches[1], batches[2]]))
    assert int(queue.queue_ptr) == 2
    assert set(dict(queue.named_buffers())) == {"queue", "queue_ptr"}
    assert set(queue.state_dict()) == {"queue", "queue_ptr"}  # persistent: checkpointed


def test_queue_rejects_size_not_multiple_of_batch() -> None:
    queue = FeatureQueue(size=10, dim=3)
    with pytest.raises(ValueError, match=r"queue size 10 .* 4 \(per-device batch × world size\)"):
        queue.enqueue(torch.randn(4, 3))
    with pytest.raises(ValueError, match="-1"):
        FeatureQueue(-1, 3)


def test_negatives_are_a_snapshot_safe_for_backward() -> None:
    queue = FeatureQueue(size=4, dim=3)
    q = torch.randn(2, 3, requires_grad=True)
    loss = InfoNCELoss()(q, torch.randn(2, 3), queue.negatives())
    queue.enqueue(torch.randn(2, 3))  # in-place write after the forward, before backward
    loss.backward()
    assert q.grad is not None
