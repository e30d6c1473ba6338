"""NT-Xent (SimCLR, Chen et al., ICML 2020, Eq. 1) against a plain-loop
reference, symmetry, the closed form for orthonormal embeddings, rank slices, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_lightning.losses import NTXentLoss


def _reference_anchor_losses(z1: np.ndarray, z2: np.ndarray, temperature: float) -> np.ndarray:
    """Eq. 1 with loops: the 2N augmented samples are [z1; z2]; sample k's positive is k ± N;
    l(i, j) = -log exp(sim(i, j)/T) / sum_{k != i} exp(sim(i, k)/T), sim = cosine.
    Returns the 2N anchor losses, in the order [view-1 anchors, view-2 anchors]."""
    samples = [np.asarray(v, dtype=np.float64) for v in (*z1, *z2)]
    n = len(z1)

    def sim(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b) / (math.sqrt(a @ a) * math.sqrt(b @ b))

    losses = []
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        denominator = sum(
            math.exp(sim(samples[i], samples[k]) / temperature) for k in range(2 * n) if k != i
        )
        losses.append(-math.log(math.exp(sim(samples[i], samples[j]) / temperature) / denominator))
    return np.array(losses)


def _embeddings(n: int = 6, d: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the comparisons with the float64 references are exact to 1e-10."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64),
            torch.randn(n, d, generator=g, dtype=torch.float64))


CHUNKS = [None, 3]  # dense logits and the memory-efficient chunked form must agree


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [0.1, 0.5, 1.0])
def test_matches_loop_reference_of_eq1(temperature: float, chunk_size: int | None) -> None:
    z1, z2 = _embeddings()
    loss = NTXentLoss(temperature, chunk_size=chunk_size)(z1, z2)
    expected = _reference_anchor_losses(z1.numpy(), z2.numpy(), temperature).mean()
    assert loss.item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_rank_slice_is_the_mean_over_its_own_anchors(chunk_size: int | None) -> None:
    """With gathered candidates, rank r's loss is the mean of the reference losses of its 2B
    anchors (the view-1 and view-2 copies of samples offset..offset+B)."""
    z1, z2 = _embeddings(n=8)
    per_anchor = _reference_anchor_losses(z1.numpy(), z2.numpy(), 0.3)
    criterion = NTXentLoss(0.3, chunk_size=chunk_size)
    for offset in (0, 2, 4):
        local = slice(offset, offset + 4)
        loss = criterion(z1[local], z2[local], z1, z2, rank_offset=offset)
        expected = np.concatenate([per_anchor[:8][local], per_anchor[8:][local]]).mean()
        assert loss.item() == pytest.approx(expected, rel=1e-10)


def test_symmetric_in_the_two_views_and_both_directions_count() -> None:
    z1, z2 = _embeddings(seed=1)
    criterion = NTXentLoss(0.2)
    torch.testing.assert_close(criterion(z1, z2), criterion(z2, z1))
    per_anchor = _reference_anchor_losses(z1.numpy(), z2.numpy(), 0.2)
    one_direction = per_anchor[:6].mean()  # only l(i, j): the asymmetric variant
    assert abs(criterion(z1, z2).item() - one_direction) > 1e-3
    assert criterion(z1, z2).item() == pytest.approx(per_anchor.mean(), rel=1e-10)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_closed_form_for_orthonormal_identical_views(n: int) -> None:
    """z1 = z2 = orthonormal rows: each positive has cosine 1, the 2n - 2 negatives cosine 0, so
    l = -log(e^{1/T} / (e^{1/T} + 2n - 2)) = log(1 + (2n - 2) e^{-1/T}) for every anchor."""
    temperature = 0.5
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(n),
                                       dtype=torch.float64))
    z = q[:n] * 3.0  # scale must not matter (cosine similarity)
    loss = NTXentLoss(temperature)(z, z.clone())
    expected = math.log(1 + (2 * n - 2) * math.exp(-1 / temperature))
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-14)


def test_gradients_match_a_float64_loop_reference() -> None:
    """Autograd through Eq. 1 written as loops vs our loss, in float64 (masking and the two
    directions must send exactly the right gradient to every embedding)."""
    z1, z2 = _embeddings(n=4, d=3, seed=2)
    a1, a2 = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    samples = [*a1, *a2]
    terms = []
    for i in range(8):
        sims = [torch.cosine_similarity(samples[i], samples[k], dim=0) / 0.4 for k in range(8)]
        denominator = sum(sims[k].exp() for k in range(8) if k != i)
        terms.append(-(sims[(i + 4) % 8].exp() / denominator).log())
    torch.stack(terms).mean().backward()
    b1, b2 = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    NTXentLoss(0.4)(b1, b2).backward()
    torch.testing.assert_close(b1.grad, a1.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(b2.grad, a2.grad, atol=1e-12, rtol=1e-10)


def test_computes_in_fp32_under_autocast() -> None:
    z1, z2 = _embeddings(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = NTXentLoss(0.2)(z1.bfloat16(), z2.bfloat16())
    assert loss.dtype == torch.float32
    expected = NTXentLoss(0.2)(z1.bfloat16().float(), z2.bfloat16().float())
    torch.testing.assert_close(loss, expected)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        NTXentLoss(0.0)
    z1, z2 = _embeddings()
    with pytest.raises(ValueError, match=r"\(6, 5\) and \(5, 5\)"):
        NTXentLoss()(z1, z2[:5])
    with pytest.raises(ValueError, match="rank_offset 7 with local batch 6"):
        NTXentLoss()(z1, z2, torch.cat([z1, z1]), torch.cat([z2, z2]), rank_offset=7)
    with pytest.raises(ValueError, match="rank_offset -1"):
        NTXentLoss()(z1, z2, rank_offset=-1)
