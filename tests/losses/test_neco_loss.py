"""NeCoLoss and the relaxed sorting networks against float64 loops written from the equations
of Petersen et al. (ICML 2021, relaxed comparators) and Pariza et al. (ICLR 2025, NeCo §3)."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses.neco import NeCoLoss
from ssl_lightning.losses.soft_sort import soft_sort, sorting_network


def _loop_soft_sort(values: list[float], steepness: float, comparators: list[tuple[int, int]]
                    ) -> list[list[float]]:
    """Relaxed network, one comparator at a time: the soft permutation matrix P[k][r]."""
    n = len(values)
    x = list(values)
    perm = [[1.0 if k == r else 0.0 for r in range(n)] for k in range(n)]
    for i, j in comparators:
        a, b = x[i], x[j]
        alpha = math.atan(steepness * (b - a)) / math.pi + 0.5
        x[i], x[j] = alpha * a + (1 - alpha) * b, (1 - alpha) * a + alpha * b
        for k in range(n):
            pi, pj = perm[k][i], perm[k][j]
            perm[k][i], perm[k][j] = alpha * pi + (1 - alpha) * pj, (1 - alpha) * pi + alpha * pj
    return perm


def _comparators(size: int, kind: str) -> list[tuple[int, int]]:
    return [pair for lower, upper in sorting_network(size, kind)  # type: ignore[arg-type]
            for pair in zip(lower, upper, strict=True)]


def _cosine(u: torch.Tensor, v: torch.Tensor) -> float:
    dot = sum(float(a) * float(b) for a, b in zip(u, v, strict=True))
    return dot / math.sqrt(sum(float(a) ** 2 for a in u) * sum(float(b) ** 2 for b in v))


def _loop_neco(student, teacher, references, beta_s, beta_t, kind) -> float:
    batch, patches, _ = student.shape
    count = references.shape[1]
    comparators = _comparators(count, kind)
    total = 0.0
    for b in range(batch):
        for i in range(patches):
            p = _loop_soft_sort([_cosine(student[b, i], references[b, k]) for k in range(count)],
                                beta_s, comparators)
            q = _loop_soft_sort([_cosine(teacher[b, i], references[b, k]) for k in range(count)],
                                beta_t, comparators)
            total -= sum(q[k][r] * math.log(p[k][r]) for k in range(count) for r in range(count))
    return total / (batch * patches * count)


@pytest.mark.parametrize("kind", ["bitonic", "odd_even"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
def test_networks_sort_every_input(kind: str, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    values = torch.randn(300, size, dtype=torch.float64, generator=generator)
    hard, perm = soft_sort(values, 1e12, kind)  # type: ignore[arg-type]
    assert torch.allclose(hard, values.sort(dim=-1).values, atol=1e-9)
    assert torch.allclose((values.unsqueeze(-2) @ perm).squeeze(-2), hard)


def test_bitonic_is_shallower_than_odd_even() -> None:
    assert len(sorting_network(49, "bitonic")) == 21  # 6·7/2 layers of the 64-entry network
    assert len(sorting_network(49, "odd_even")) == 49


@pytest.mark.parametrize("kind", ["bitonic", "odd_even"])
def test_soft_permutation_equals_loop(kind: str) -> None:
    values = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    perm = soft_sort(values[None], 2.5, kind)[1][0]  # type: ignore[arg-type]
    expected = torch.tensor(_loop_soft_sort(values.tolist(), 2.5, _comparators(6, kind)),
                            dtype=torch.float64)
    assert torch.allclose(perm, expected, atol=1e-12)
    assert torch.allclose(perm.sum(0), torch.ones(6, dtype=torch.float64))
    assert torch.allclose(perm.sum(1), torch.ones(6, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["bitonic", "odd_even"])
def test_loss_equals_float64_loop(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(2, 3, 4, dtype=torch.float64, generator=g) for _ in range(2))
    references = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    loss = NeCoLoss(7.0, 3.0, network=kind)(student, teacher, references)  # type: ignore[arg-type]
    expected = _loop_neco(student, teacher, references, 7.0, 3.0, kind)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_known_bad_variant_fails_the_reference() -> None:
    """Student and teacher swapped (the teacher's matrix inside the log) is another value."""
    g = torch.Generator().manual_seed(1)
    student, teacher = (torch.randn(2, 3, 4, dtype=torch.float64, generator=g) for _ in range(2))
    references = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    swapped = NeCoLoss(3.0, 7.0)(teacher, student, references).item()
    assert swapped != pytest.approx(_loop_neco(student, teacher, references, 7.0, 3.0,
                                               "bitonic"), rel=1e-6)


def test_gradient_reaches_the_student_only() -> None:
    g = torch.Generator().manual_seed(2)
    student = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    teacher = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    references = torch.randn(2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    NeCoLoss(5.0, 5.0)(student, teacher, references).backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None and references.grad is None


def test_agreeing_orders_give_a_lower_loss() -> None:
    g = torch.Generator().manual_seed(4)
    teacher = torch.randn(2, 6, 8, dtype=torch.float64, generator=g)
    references = torch.randn(2, 8, 8, dtype=torch.float64, generator=g)
    criterion = NeCoLoss(20.0, 20.0)
    same = criterion(teacher, teacher, references)
    other = criterion(torch.randn(2, 6, 8, dtype=torch.float64, generator=g), teacher, references)
    assert same < other


def test_bad_arguments_fail_with_one_line() -> None:
    with pytest.raises(ValueError, match="steepnesses must be > 0"):
        NeCoLoss(0.0)
    with pytest.raises(ValueError, match="network must be"):
        NeCoLoss(network="bubble")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Expected student and teacher patches"):
        NeCoLoss()(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 5, 3))
