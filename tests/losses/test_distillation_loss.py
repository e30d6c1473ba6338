"""Distillation loss terms (losses/distillation.py) against float64 loops written from the
formulas of the module docstring, plus closed-form properties."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses.distillation import (
    DistillationLoss,
    PatchSimilarityDistillationLoss,
    QueueDistillationLoss,
)

T = 0.07


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _kl(p_logits: list[float], q_logits: list[float]) -> float:
    """KL(softmax(p) || softmax(q)) written out with exp and sums."""
    zp = sum(math.exp(x) for x in p_logits)
    zq = sum(math.exp(x) for x in q_logits)
    return sum(math.exp(a) / zp * ((a - math.log(zp)) - (b - math.log(zq)))
               for a, b in zip(p_logits, q_logits, strict=True))


def _global_reference(s: torch.Tensor, t: torch.Tensor, q: torch.Tensor) -> float:
    queue = q.tolist()
    total = 0.0
    for s_b, t_b in zip(s.tolist(), t.tolist(), strict=True):
        su, tu = _unit(s_b), _unit(t_b)
        total += _kl([_dot(tu, k) / T for k in queue], [_dot(su, k) / T for k in queue])
    return total / len(s)


def _local_reference(s: torch.Tensor, t: torch.Tensor) -> float:
    total, rows = 0.0, 0
    for s_img, t_img in zip(s.tolist(), t.tolist(), strict=True):
        su, tu = [_unit(v) for v in s_img], [_unit(v) for v in t_img]
        for i in range(len(su)):
            others = [j for j in range(len(su)) if j != i]
            total += _kl([_dot(tu[i], tu[j]) / T for j in others],
                         [_dot(su[i], su[j]) / T for j in others])
            rows += 1
    return total / rows


def test_global_term_equals_the_formula() -> None:
    s, t = _rand(5, 6, seed=0), _rand(5, 6, seed=1)
    q = torch.nn.functional.normalize(_rand(7, 6, seed=2), dim=1)
    loss = QueueDistillationLoss(T)(s, t, q)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - _global_reference(s, t, q)) < 1e-9


def test_local_term_equals_the_formula_without_the_self_pair() -> None:
    s, t = _rand(3, 5, 4, seed=3), _rand(3, 5, 4, seed=4)
    loss = PatchSimilarityDistillationLoss(T)(s, t)
    assert abs(loss.item() - _local_reference(s, t)) < 1e-9


def test_variants_compose_the_terms_and_patch_mse_is_the_mean_square() -> None:
    sg, tg, q = _rand(4, 6, seed=5), _rand(4, 6, seed=6), _rand(8, 6, seed=7)
    q = torch.nn.functional.normalize(q, dim=1)
    sp, tp = _rand(4, 9, 6, seed=8), _rand(4, 9, 6, seed=9)
    both = DistillationLoss("global_local", T, T, local_weight=0.5)(sg, tg, q, sp, tp)
    assert abs(both.item() - _global_reference(sg, tg, q) - 0.5 * _local_reference(sp, tp)) < 1e-9
    only_global = DistillationLoss("global")(sg, tg, q, None, None)
    assert abs(only_global.item() - _global_reference(sg, tg, q)) < 1e-9
    mse = DistillationLoss("patch_mse")(None, None, None, sp, tp)
    squares = [(a - b) ** 2 for a, b in zip(sp.flatten().tolist(), tp.flatten().tolist(),
                                                     strict=True)]
    assert abs(mse.item() - sum(squares) / len(squares)) < 1e-12


def test_zero_when_the_student_matches_the_teacher() -> None:
    t, q = _rand(4, 6, seed=10), torch.nn.functional.normalize(_rand(8, 6, seed=11), dim=1)
    assert QueueDistillationLoss(T)(3 * t, t, q).abs().item() < 1e-12  # scale-free
    tp = _rand(2, 5, 6, seed=12)
    assert PatchSimilarityDistillationLoss(T)(tp.clone(), tp).abs().item() < 1e-12


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        QueueDistillationLoss(0)
    with pytest.raises(ValueError, match="variant must be one of"):
        DistillationLoss("local")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'patch_mse' needs student_patches"):
        DistillationLoss("patch_mse")(None, None, None, None, None)
    with pytest.raises(ValueError, match="N >= 2"):
        PatchSimilarityDistillationLoss()(torch.zeros(2, 1, 3), torch.zeros(2, 1, 3))
