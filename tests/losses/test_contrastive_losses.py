"""DCL/DCLW, SupCon, the NNCLR loss and NT-Xent's memory bank and
margin against float64 loop references of their papers' equations; properties (DCL's denominator
has no positive, DCLW's weights, SupCon with one positive is NT-Xent, the margin's closed form);
chunked = dense; float64 kept, half promoted; bad input (fp32 precision: test_loss_fp32.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_lightning.losses import DCLLoss, NNCLRLoss, NTXentLoss, SupConLoss


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _views(n: int, d: int = 6, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(2)]


def _dcl_reference(z1, z2, temperature: float, sigma: float | None) -> float:
    """Yeh et al. Eq. (6)/(7) with loops: -w_i s_i+ + log sum over the 2N-2 negatives."""
    z = np.concatenate([_unit(z1), _unit(z2)])
    n = len(z1)
    pos = [z[i] @ z[i + n] for i in range(n)]
    if sigma is None:
        w = [1.0] * n
    else:
        mean = sum(math.exp(p / sigma) for p in pos) / n
        w = [2 - math.exp(p / sigma) / mean for p in pos]
    total = 0.0
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        negatives = sum(math.exp(z[i] @ z[k] / temperature)
                        for k in range(2 * n) if k not in (i, j))
        total += -w[i % n] * (z[i] @ z[j]) / temperature + math.log(negatives)
    return total / (2 * n)


def _supcon_reference(z1, z2, labels, temperature: float) -> float:
    """Khosla et al. Eq. (2) (L^sup_out) with loops over anchors, positives and A(i)."""
    z = np.concatenate([_unit(z1), _unit(z2)])
    y = np.concatenate([labels, labels])
    total = 0.0
    for i in range(len(z)):
        denominator = sum(math.exp(z[i] @ z[a] / temperature) for a in range(len(z)) if a != i)
        positives = [p for p in range(len(z)) if p != i and y[p] == y[i]]
        total += -sum(math.log(math.exp(z[i] @ z[p] / temperature) / denominator)
                      for p in positives) / len(positives)
    return total / len(z)


def _nt_xent_margin_reference(z1, z2, temperature: float, margin: float) -> float:
    """SimCLR Eq. (1) with the margin taken off the positive cosine, loops."""
    z = np.concatenate([_unit(z1), _unit(z2)])
    n = len(z1)
    total = 0.0
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        s = [(z[i] @ z[k] - (margin if k == j else 0.0)) / temperature for k in range(2 * n)]
        total += -s[j] + math.log(sum(math.exp(s[k]) for k in range(2 * n) if k != i))
    return total / (2 * n)


def _nnclr_reference(neighbours, predictions_all, offset: int, temperature: float) -> float:
    """Dwibedi et al. Eq. (2): neighbour i against all gathered predictions, prediction
    ``offset + i`` as its positive."""
    a, p = _unit(neighbours), _unit(predictions_all)
    total = 0.0
    for i in range(len(a)):
        total += -a[i] @ p[offset + i] / temperature + math.log(
            sum(math.exp(a[i] @ p[k] / temperature) for k in range(len(p))))
    return total / len(a)


@pytest.mark.parametrize("sigma", [None, 0.5])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_dcl_and_dclw_match_loop_reference(sigma: float | None, chunk_size: int | None) -> None:
    z1, z2 = _views(7)
    loss = DCLLoss(0.3, sigma, chunk_size)(z1, z2)
    assert loss.dtype == torch.float64
    expected = _dcl_reference(z1.detach().numpy(), z2.detach().numpy(), 0.3, sigma)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_dcl_denominator_excludes_the_positive() -> None:
    """NT-Xent_i = DCL_i + log(1 + exp(s_i+ - lse_neg_i)): the only difference is the positive
    in the denominator. For identical views the DCL positive term is the whole story."""
    z1, z2 = _views(6)
    t = 0.2
    dcl = DCLLoss(t, chunk_size=None)(z1, z2)
    nt_xent = NTXentLoss(t, chunk_size=None)(z1, z2)
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1).detach()
    n = len(z1)
    logits = z @ z.T / t
    pos_idx = (torch.arange(2 * n) + n) % (2 * n)
    pos = logits[torch.arange(2 * n), pos_idx]
    logits.fill_diagonal_(-math.inf)
    logits[torch.arange(2 * n), pos_idx] = -math.inf
    lse_neg = torch.logsumexp(logits, dim=1)
    torch.testing.assert_close(nt_xent - dcl, torch.nn.functional.softplus(pos - lse_neg).mean(),
                               atol=1e-12, rtol=0)
    assert nt_xent.item() > dcl.item()


def test_dclw_weights_match_the_formula() -> None:
    """DCLW - DCL = -(1/2N) sum_i (w_i - 1) s_i+ over both directions, with the paper's
    w_i = 2 - exp(s_i/σ) / mean_j exp(s_j/σ); the weights average to 1."""
    z1, z2 = _views(5)
    t, sigma = 0.4, 0.5
    diff = DCLLoss(t, sigma, None)(z1, z2) - DCLLoss(t, None, None)(z1, z2)
    cos = (torch.nn.functional.normalize(z1, dim=1)
           * torch.nn.functional.normalize(z2, dim=1)).sum(1).detach().numpy()
    e = np.exp(cos / sigma)
    w = 2 - e / e.mean()
    assert w.mean() == pytest.approx(1.0, abs=1e-12)
    assert diff.item() == pytest.approx(-((w - 1) * cos / t).mean(), abs=1e-12)
    # σ -> ∞: every weight -> 1, DCLW -> DCL.
    far = DCLLoss(t, 1e9, None)(z1, z2) - DCLLoss(t, None, None)(z1, z2)
    assert abs(far.item()) < 1e-7


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_supcon_matches_loop_reference_with_repeated_labels(chunk_size: int | None) -> None:
    z1, z2 = _views(9)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 5, 2, 2])
    loss = SupConLoss(0.25, chunk_size)(z1, z2, labels)
    assert loss.dtype == torch.float64
    expected = _supcon_reference(z1.detach().numpy(), z2.detach().numpy(), labels.numpy(), 0.25)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_supcon_with_one_positive_per_anchor_is_nt_xent(chunk_size: int | None) -> None:
    z1, z2 = _views(8)
    distinct = torch.arange(8) * 3
    supcon = SupConLoss(0.2, chunk_size)(z1, z2, distinct)
    nt_xent = NTXentLoss(0.2, chunk_size)(z1, z2)
    torch.testing.assert_close(supcon, nt_xent, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_margin_matches_loop_reference(chunk_size: int | None) -> None:
    z1, z2 = _views(6)
    loss = NTXentLoss(0.3, chunk_size, margin=0.2)(z1, z2)
    expected = _nt_xent_margin_reference(z1.detach().numpy(), z2.detach().numpy(), 0.3, 0.2)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("margin", [0.0, 0.1, 0.5])
def test_margin_closed_form_for_orthonormal_identical_views(margin: float) -> None:
    """Positives at cosine 1 - m, the 2N-2 negatives at 0: l = log(e^((1-m)/T) + 2N-2) - (1-m)/T."""
    n, t = 4, 0.5
    z = torch.eye(n, dtype=torch.float64)
    expected = math.log(math.exp((1 - margin) / t) + 2 * n - 2) - (1 - margin) / t
    for chunk_size in (None, 2):
        loss = NTXentLoss(t, chunk_size, margin=margin)(z, z.clone())
        assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_nnclr_loss_matches_loop_reference_with_gathered_predictions() -> None:
    g = torch.Generator().manual_seed(3)
    neighbours = torch.randn(3, 5, generator=g, dtype=torch.float64)
    predictions_all = torch.randn(9, 5, generator=g, dtype=torch.float64)
    for chunk_size in (None, 2):
        loss = NNCLRLoss(0.1, chunk_size)(neighbours, predictions_all, rank_offset=3)
        # The denominator runs over all 9 gathered predictions, not only the local 3.
        expected = _nnclr_reference(neighbours.numpy(), predictions_all.numpy(), 3, 0.1)
        assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_memory_bank_matches_loop_reference_and_enqueues_view_2() -> None:
    z1, z2 = _views(4, d=5)
    loss_fn = NTXentLoss(0.3, None, margin=0.1, memory_bank_size=8, embedding_dim=5).double()
    bank = loss_fn.bank.queue.clone()
    loss = loss_fn(z1, z2)
    a, p, b = _unit(z1.detach().numpy()), _unit(z2.detach().numpy()), _unit(bank.numpy())
    expected = np.mean([
        -(a[i] @ p[i] - 0.1) / 0.3
        + math.log(math.exp((a[i] @ p[i] - 0.1) / 0.3) + np.exp(a[i] @ b.T / 0.3).sum())
        for i in range(4)])
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    np.testing.assert_allclose(loss_fn.bank.queue[:4].numpy(), p, atol=1e-15)
    torch.testing.assert_close(loss_fn.bank.queue[4:], bank[4:], atol=0, rtol=0)
    assert int(loss_fn.bank.queue_ptr) == 4
    with torch.no_grad():  # evaluation: no enqueue
        loss_fn(z1.detach(), z2.detach())
    assert int(loss_fn.bank.queue_ptr) == 4


def _loss_and_grads(make, chunk_size, *inputs):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    loss = make(chunk_size)(*leaves)
    wrt = [x for x in leaves if x.requires_grad]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return loss, [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads, strict=True)]


CASES = {
    "margin": lambda c: NTXentLoss(0.2, c, margin=0.3),
    "bank": lambda c: NTXentLoss(0.2, c, memory_bank_size=12, embedding_dim=6).double(),
    "dcl": lambda c: DCLLoss(0.2, None, c),
    "dclw": lambda c: DCLLoss(0.2, 0.5, c),
    "supcon": lambda c: SupConLoss(0.2, c),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_equals_dense_for_the_new_options(name: str) -> None:
    """Local anchors of rank 1 against candidates of 3 ranks; loss and every gradient."""
    g = torch.Generator().manual_seed(11)
    b = 4
    z1_all, z2_all = (torch.randn(3 * b, 6, generator=g, dtype=torch.float64) for _ in range(2))
    z1, z2 = z1_all[b:2 * b], z2_all[b:2 * b]
    if name == "supcon":
        labels_all = torch.randint(3, (3 * b,), generator=g)
        inputs = (z1, z2, labels_all[b:2 * b], z1_all, z2_all, labels_all)
    else:
        inputs = (z1, z2, z1_all, z2_all)
    results = [_loss_and_grads(lambda c: _with_offset(CASES[name](c), b), c, *inputs)
               for c in (None, 1, 3, 64)]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-12, rtol=0)
        for got, want in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def _with_offset(loss_fn, offset: int):
    return lambda *args: loss_fn(*args, rank_offset=offset)


def test_nnclr_chunked_equals_dense() -> None:
    g = torch.Generator().manual_seed(2)
    neighbours = torch.randn(4, 6, generator=g, dtype=torch.float64)
    predictions = torch.randn(12, 6, generator=g, dtype=torch.float64)
    results = [_loss_and_grads(lambda c: _with_offset(NNCLRLoss(0.1, c), 4), c, neighbours,
                               predictions) for c in (None, 1, 3)]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-12, rtol=0)
        torch.testing.assert_close(grads[1], results[0][1][1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_float64_stays_float64_and_half_is_promoted(chunk_size: int | None) -> None:
    z1, z2 = _views(8)
    labels = torch.arange(8) % 3
    for half in (False, True):
        a, b = (z1.bfloat16(), z2.bfloat16()) if half else (z1, z2)
        want = torch.float32 if half else torch.float64
        assert NTXentLoss(0.2, chunk_size)(a, b).dtype == want
        assert NTXentLoss(0.2, chunk_size, memory_bank_size=16, embedding_dim=6)(a, b).dtype == want
        assert DCLLoss(0.2, 0.5, chunk_size)(a, b).dtype == want
        assert SupConLoss(0.2, chunk_size)(a, b, labels).dtype == want
        assert NNCLRLoss(0.2, chunk_size)(a, b).dtype == want


def test_bad_input_is_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match="margin must be >= 0, got -0.1"):
        NTXentLoss(0.2, margin=-0.1)
    with pytest.raises(ValueError, match="needs embedding_dim"):
        NTXentLoss(0.2, memory_bank_size=64)
    with pytest.raises(ValueError, match="memory_bank_size must be >= 0"):
        NTXentLoss(0.2, memory_bank_size=-1)
    bank = NTXentLoss(0.2, memory_bank_size=10, embedding_dim=6)
    with pytest.raises(ValueError, match="queue size 10 must be a multiple .* 4"):
        bank(*_views(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="weight_sigma must be > 0"):
        DCLLoss(0.2, weight_sigma=0.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SupConLoss(0.0)
    z1, z2 = _views(4)
    with pytest.raises(ValueError, match="2 of the 4 samples of the batch have target -1"):
        SupConLoss()(z1, z2, torch.tensor([0, -1, 1, -1]))


def test_support_set_nearest_is_the_highest_cosine_row() -> None:
    from ssl_lightning.queues import FeatureQueue

    queue = FeatureQueue(6, 4)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(5, 4, generator=g)
    want = (torch.nn.functional.normalize(query, dim=1) @ queue.queue.T).argmax(dim=1)
    torch.testing.assert_close(queue.nearest(3.0 * query), queue.queue[want], atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not fit"):
        queue.nearest(torch.randn(2, 3))


@pytest.mark.parametrize("labels", [[0] * 7, [0, 0, 0, 1, 1, 1, 1], [4, 0, 4, 1, 2, 3, 0]])
def test_supcon_chunked_equals_dense_with_gradients(labels: list[int]) -> None:
    """One class only (no negatives at all), two classes and a mix, at chunk sizes that cut the
    classes: loss and gradients of the chunked kernel (gradient products in the forward pass)
    equal the dense autograd ones; under no_grad the value is the same."""
    z1, z2 = _views(7, seed=3)
    results = [_loss_and_grads(lambda c: SupConLoss(0.3, c), c, z1, z2, torch.tensor(labels))
               for c in (None, 1, 4, 64)]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-12, rtol=0)
        for got, want in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(SupConLoss(0.3, 4)(z1, z2, torch.tensor(labels)),
                                   results[0][0], atol=1e-12, rtol=0)


def test_supcon_fp32_far_below_the_norm_bound_matches_float64() -> None:
    """At T = 0.01 rows whose positives are opposite the anchor have their positive sum far
    below the bound shift (the exact per-group recompute) and logits below fp32's exp range
    (the clamp): fp32 loss and gradients stay at fp32 rounding of float64."""
    g = torch.Generator().manual_seed(7)
    z1 = torch.randn(6, 5, generator=g, dtype=torch.float64)
    z2 = torch.cat([-z1[:3] + 0.01 * torch.randn(3, 5, generator=g, dtype=torch.float64),
                    z1[3:] + 0.01 * torch.randn(3, 5, generator=g, dtype=torch.float64)])
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    exact, exact_grads = _loss_and_grads(lambda c: SupConLoss(0.01, c), 4, z1, z2, labels)
    fp32, fp32_grads = _loss_and_grads(lambda c: SupConLoss(0.01, c), 4, z1.float(),
                                       z2.float(), labels)
    assert abs(fp32.item() - exact.item()) / exact.item() < 1e-6
    for got, want in zip(fp32_grads, exact_grads, strict=True):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
