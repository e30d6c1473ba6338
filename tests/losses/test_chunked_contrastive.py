"""The chunked (memory-efficient) log-sum-exp and NT-Xent: equal to the dense version and to a
plain-loop reference of SimCLR Eq. (1), in loss and gradients, also with gathered candidates and
under 2-process DDP. Chunked = dense is an exactness check: float64, bound 1e-10 (the paths
differ by float64 summation order, ~1e-16)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.distributed import all_gather_no_grad, all_gather_with_grad
from ssl_lightning.losses import NTXentLoss
from ssl_lightning.losses.chunked_contrastive import (
    ClassMask,
    chunked_logsumexp,
    logsumexp_gap_mean,
)

EXACT = 1e-10
F64 = torch.float64


def _nt_xent_reference(z1: np.ndarray, z2: np.ndarray, temperature: float) -> float:
    """SimCLR Eq. (1) with plain loops over the 2N samples, float64."""
    z = np.concatenate([z1, z2]).astype(np.float64)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    n = len(z1)
    total = 0.0
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        denominator = sum(math.exp(z[i] @ z[k] / temperature) for k in range(2 * n) if k != i)
        total += -math.log(math.exp(z[i] @ z[j] / temperature) / denominator)
    return total / (2 * n)


@pytest.mark.parametrize("n,chunk_size", [(5, 1), (5, 3), (8, 4), (8, 16), (13, 5), (16, 1024)])
def test_chunked_nt_xent_matches_loop_reference_and_dense_gradients(n: int, chunk_size: int):
    g = torch.Generator().manual_seed(n * 100 + chunk_size)
    z1 = torch.randn(n, 7, generator=g, dtype=F64, requires_grad=True)
    z2 = torch.randn(n, 7, generator=g, dtype=F64, requires_grad=True)
    temperature = 0.3
    chunked = NTXentLoss(temperature, chunk_size=chunk_size)(z1, z2)
    grads_chunked = torch.autograd.grad(chunked, [z1, z2])
    dense = NTXentLoss(temperature, chunk_size=None)(z1, z2)
    grads_dense = torch.autograd.grad(dense, [z1, z2])
    reference = _nt_xent_reference(z1.detach().numpy(), z2.detach().numpy(), temperature)
    assert chunked.dtype == F64
    assert chunked.item() == pytest.approx(reference, abs=EXACT)
    torch.testing.assert_close(chunked, dense, atol=EXACT, rtol=0)
    for a, b in zip(grads_chunked, grads_dense, strict=True):
        torch.testing.assert_close(a, b, atol=EXACT, rtol=0)


@pytest.mark.parametrize("chunk_size", [2, 5, 6, 64])
def test_chunked_nt_xent_with_gathered_candidates(chunk_size: int):
    """Local anchors vs candidates gathered from 3 ranks (this rank is rank 1): loss and the
    gradients into the local tensors AND the gathered ones match the dense loss."""
    batch, world, rank = 3, 3, 1
    g = torch.Generator().manual_seed(chunk_size)
    leaves = [torch.randn(n, 5, generator=g, dtype=F64, requires_grad=True)
              for n in (batch, batch, world * batch, world * batch)]
    results = []
    for size in (chunk_size, None):
        loss = NTXentLoss(0.2, chunk_size=size)(*leaves, rank_offset=rank * batch)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (loss_c, grads_c), (loss_d, grads_d) = results
    torch.testing.assert_close(loss_c, loss_d, atol=EXACT, rtol=0)
    for a, b in zip(grads_c, grads_d, strict=True):
        assert b.abs().max() > 1e-3  # every input, the gathered ones too, gets a gradient
        torch.testing.assert_close(a, b, atol=EXACT, rtol=0)


@pytest.mark.parametrize("with_exclude", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 100])
def test_chunked_logsumexp_matches_torch(with_exclude: bool, chunk_size: int):
    g = torch.Generator().manual_seed(chunk_size)
    anchors = (torch.randn(9, 6, generator=g, dtype=F64) / 6**0.5).requires_grad_()  # ~unit norm
    candidates = (torch.randn(14, 6, generator=g, dtype=F64) / 6**0.5).requires_grad_()
    exclude = torch.randint(0, 14, (9,), generator=g) if with_exclude else None
    weights = torch.randn(9, generator=g, dtype=F64)
    lse = chunked_logsumexp(anchors, candidates, 0.5, exclude, chunk_size)
    grads = torch.autograd.grad((lse * weights).sum(), [anchors, candidates])
    logits = anchors @ candidates.T / 0.5
    if exclude is not None:
        logits = logits.index_put((torch.arange(9), exclude), torch.tensor(-math.inf, dtype=F64))
    expected = torch.logsumexp(logits, dim=1)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [anchors, candidates])
    torch.testing.assert_close(lse, expected, atol=EXACT, rtol=0)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, atol=EXACT, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_rows_far_below_the_norm_bound_are_exact(dtype: torch.dtype):
    """At T = 0.01 anchors opposite every kept candidate have logits ~ -100 against a bound
    shift of +100: exp(logit - shift) underflows and the kernel must redo those rows with their
    exact max (float64 reference; fp32 to its rounding)."""
    g = torch.Generator().manual_seed(3)
    candidates = torch.nn.functional.normalize(torch.randn(12, 5, generator=g, dtype=F64), dim=1)
    anchors = torch.cat([-candidates[:4] + 0.01 * torch.randn(4, 5, generator=g, dtype=F64),
                         torch.randn(4, 5, generator=g, dtype=F64)])
    anchors = torch.nn.functional.normalize(anchors, dim=1)
    kept = torch.zeros(8, 12, dtype=torch.bool)
    kept[:4, :4] = torch.eye(4, dtype=torch.bool)  # rows 0-3 keep only their opposite column
    kept[4:] = True
    exclude = torch.stack([(~row).nonzero()[:, 0] for row in kept[:4]] * 2)  # (8, 11)
    exclude[4:] = 0  # rows 4-7 leave out column 0 only
    kept[4:, 0] = False
    a, c = anchors.to(dtype).requires_grad_(), candidates.to(dtype).requires_grad_()
    weights = torch.randn(8, generator=g, dtype=F64)
    lse = chunked_logsumexp(a, c, 0.01, exclude, 4)
    grads = torch.autograd.grad((lse.double() * weights).sum(), [a, c])
    a64, c64 = a.detach().double().requires_grad_(), c.detach().double().requires_grad_()
    logits = (a64 @ c64.T / 0.01).masked_fill(~kept, -math.inf)
    expected = torch.logsumexp(logits, dim=1)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [a64, c64])
    assert expected[:4].max() < -90
    tolerance = EXACT if dtype == F64 else 1e-5  # relative to the largest entry
    for got, want in zip([lse, *grads], [expected, *expected_grads], strict=True):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance


def test_detached_candidates_get_no_gradient_and_anchors_the_same_one():
    anchors = torch.randn(6, 4, dtype=F64, requires_grad=True)
    candidates = torch.randn(9, 4, dtype=F64)
    (grad,) = torch.autograd.grad(chunked_logsumexp(anchors, candidates, 0.5, None, 4).sum(),
                                  [anchors])
    (expected,) = torch.autograd.grad(torch.logsumexp(anchors @ candidates.T / 0.5, 1).sum(),
                                      [anchors])
    torch.testing.assert_close(grad, expected, atol=EXACT, rtol=0)


def test_chunked_is_fp32_under_bf16_inputs():
    anchors = torch.randn(6, 4).bfloat16()
    lse = chunked_logsumexp(anchors, anchors, 0.1, torch.arange(6), 4)
    expected = chunked_logsumexp(anchors.float(), anchors.float(), 0.1, torch.arange(6), 4)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, expected, atol=0, rtol=0)


@pytest.mark.parametrize("kwargs", [{"chunk_size": 0}, {"temperature": 0.0}])
def test_invalid_hyperparameters_are_rejected(kwargs: dict):
    with pytest.raises(ValueError, match=str(next(iter(kwargs.values())))):
        NTXentLoss(**kwargs)
    with pytest.raises(ValueError):
        chunked_logsumexp(torch.ones(2, 2), torch.ones(2, 2), **{"temperature": 0.5, **kwargs})


# ------------------------------------------------------------------------- 2-process DDP
_BATCH, _WORLD, _CHUNK = 4, 2, 3


def _data_and_model() -> tuple[torch.Tensor, torch.Tensor, torch.nn.Linear]:
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(_WORLD * _BATCH, 6, generator=g, dtype=F64)
    x2 = torch.randn(_WORLD * _BATCH, 6, generator=g, dtype=F64)
    torch.manual_seed(1)
    return x1, x2, torch.nn.Linear(6, 5).double()


def _gather_own_slice_only(z: torch.Tensor, rank: int) -> torch.Tensor:
    """Known-bad gather: its backward keeps only the gradient of this rank's own loss."""
    gathered = all_gather_no_grad(z.detach())
    return torch.cat([gathered[: rank * len(z)], z, gathered[(rank + 1) * len(z):]])


def _ddp_rank(rank: int, world_size: int, variant: str) -> tuple[torch.Tensor, list]:
    x1, x2, model = _data_and_model()
    local = slice(rank * _BATCH, (rank + 1) * _BATCH)
    z1, z2 = model(x1[local]), model(x2[local])
    if variant == "good":
        z1_all, z2_all = all_gather_with_grad(z1), all_gather_with_grad(z2)
    else:
        z1_all, z2_all = _gather_own_slice_only(z1, rank), _gather_own_slice_only(z2, rank)
    loss = NTXentLoss(0.5, chunk_size=_CHUNK)(z1, z2, z1_all, z2_all, rank * _BATCH)
    loss.backward()
    average_gradients_like_ddp(model)
    return loss.detach(), [p.grad for p in model.parameters()]


def _ddp_both_variants(rank: int, world_size: int) -> dict:
    return {variant: _ddp_rank(rank, world_size, variant) for variant in ("good", "bad")}


@pytest.mark.slow
def test_chunked_nt_xent_two_process_ddp_equals_single_process():
    x1, x2, model = _data_and_model()
    loss = NTXentLoss(0.5, chunk_size=None)(model(x1), model(x2))  # dense, global batch
    loss.backward()
    expected_grads = [p.grad for p in model.parameters()]
    results = run_in_processes(_ddp_both_variants, _WORLD)
    good = [r["good"] for r in results]
    torch.testing.assert_close(torch.stack([r[0] for r in good]).mean(), loss.detach(),
                               atol=EXACT, rtol=0)
    for rank_result in good:
        for a, b in zip(rank_result[1], expected_grads, strict=True):
            torch.testing.assert_close(a, b, atol=EXACT, rtol=0)
    # The same test catches a gather whose backward drops the other ranks' gradients.
    bad_grads = results[0]["bad"][1]
    pairs = zip(bad_grads, expected_grads, strict=True)
    assert max((a - b).abs().max().item() for a, b in pairs) > 1e-3


def _gap_mean_reference(a: np.ndarray, c: np.ndarray, positive: np.ndarray, temperature: float,
                        exclude: np.ndarray | None, softplus: bool) -> float:
    """``mean_i h(log sum_{k kept} exp(a_i·c_k / T) - positive_i)`` with plain loops, float64."""
    total = 0.0
    for i in range(len(a)):
        left_out = set() if exclude is None else set(exclude[i].tolist())
        lse = math.log(sum(math.exp(a[i] @ c[k] / temperature) for k in range(len(c))
                           if k not in left_out))
        gap = lse - positive[i]
        total += math.log1p(math.exp(gap)) if softplus else gap
    return total / len(a)


@pytest.mark.parametrize("softplus", [True, False])
@pytest.mark.parametrize("with_exclude", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_gap_mean_matches_the_loop_reference_and_the_dense_gradients(
    softplus: bool, with_exclude: bool, chunk_size: int
):
    """The gradient products taken in the forward pass equal autograd through the dense logits,
    for the anchors, the candidates and the positive logits."""
    g = torch.Generator().manual_seed(chunk_size + 10 * with_exclude + 100 * softplus)
    anchors = torch.randn(9, 5, generator=g, dtype=F64).requires_grad_()
    candidates = torch.randn(13, 5, generator=g, dtype=F64).requires_grad_()
    positive = torch.randn(9, generator=g, dtype=F64).requires_grad_()
    exclude = torch.randint(0, 13, (9, 2), generator=g) if with_exclude else None
    leaves = [anchors, candidates, positive]
    results = []
    for size in (chunk_size, None):
        loss = logsumexp_gap_mean(anchors, candidates, positive, 0.4, exclude, size, softplus)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (loss_c, grads_c), (loss_d, grads_d) = results
    reference = _gap_mean_reference(anchors.detach().numpy(), candidates.detach().numpy(),
                                    positive.detach().numpy(), 0.4,
                                    None if exclude is None else exclude.numpy(), softplus)
    assert loss_c.item() == pytest.approx(reference, abs=EXACT)
    torch.testing.assert_close(loss_c, loss_d, atol=EXACT, rtol=0)
    for a, b in zip(grads_c, grads_d, strict=True):
        assert b.abs().max() > 1e-3
        torch.testing.assert_close(a, b, atol=EXACT, rtol=0)


def test_gap_mean_with_detached_candidates_and_without_gradients():
    """Detached candidates get no gradient products; under no_grad the value is the same."""
    g = torch.Generator().manual_seed(4)
    anchors = torch.randn(7, 4, generator=g, dtype=F64, requires_grad=True)
    candidates, positive = torch.randn(11, 4, generator=g, dtype=F64), torch.zeros(7, dtype=F64)
    loss = logsumexp_gap_mean(anchors, candidates, positive, 0.5, None, 3)
    (grad,) = torch.autograd.grad(loss, [anchors])
    dense = logsumexp_gap_mean(anchors, candidates, positive, 0.5, None, None)
    (expected,) = torch.autograd.grad(dense, [anchors])
    torch.testing.assert_close(grad, expected, atol=EXACT, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(logsumexp_gap_mean(anchors, candidates, positive, 0.5, None, 3),
                                   loss.detach(), atol=EXACT, rtol=0)


@pytest.mark.parametrize("temperature", [0.01, 0.005])
def test_gap_mean_below_the_exp_range_in_fp32(temperature: float):
    """At T = 0.01 the shifted logits reach -200, below fp32's exp range: the clamp to the
    smallest normal number keeps loss and gradients at fp32 rounding of float64."""
    g = torch.Generator().manual_seed(2)
    z = torch.nn.functional.normalize(torch.randn(24, 6, generator=g, dtype=F64), dim=1)
    anchors, candidates = z[:12], torch.cat([z[12:], -z[:12]])
    positive = (anchors * z[12:]).sum(dim=1) / temperature
    outs = []
    for dtype in (F64, torch.float32):
        leaves = [anchors.to(dtype).requires_grad_(), candidates.to(dtype).requires_grad_()]
        loss = logsumexp_gap_mean(*leaves, positive.to(dtype), temperature, None, 5)
        outs.append([loss, *torch.autograd.grad(loss, leaves)])
    for want, got in zip(*outs, strict=True):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_chunked_logsumexp_with_a_class_mask_matches_the_dense_path(same: bool, chunk_size: int):
    """Left-out entries are zeroed after exp in the chunked path, set to finfo.min in the dense
    one: equal log-sum-exp and gradients, with the anchor's own column left out as well."""
    g = torch.Generator().manual_seed(chunk_size)
    anchors = torch.randn(8, 5, generator=g, dtype=F64, requires_grad=True)
    candidates = torch.randn(12, 5, generator=g, dtype=F64, requires_grad=True)
    classes = ClassMask(torch.randint(0, 3, (8,), generator=g), torch.arange(12) % 3, same)
    weights = torch.randn(8, generator=g, dtype=F64)
    results = []
    for size in (chunk_size, None):
        lse = chunked_logsumexp(anchors, candidates, 0.3, torch.arange(8), size, classes)
        results.append((lse, torch.autograd.grad((lse * weights).sum(), [anchors, candidates])))
    (lse_c, grads_c), (lse_d, grads_d) = results
    torch.testing.assert_close(lse_c, lse_d, atol=EXACT, rtol=0)
    for a, b in zip(grads_c, grads_d, strict=True):
        torch.testing.assert_close(a, b, atol=EXACT, rtol=0)
