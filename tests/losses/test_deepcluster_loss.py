"""DeepClusterLoss (SwAV paper, Appendix: DeepCluster v2) against a float64 loop reference of
``1/H sum_h mean_{i,v} -log softmax(s_{h,i,v} / tau)[a_{h,i}]``, and its checks."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses import DeepClusterLoss


def _reference(scores: list[list[list[list[float]]]], assignments: list[list[int]],
               tau: float) -> float:
    heads = []
    for head, targets in zip(scores, assignments, strict=True):
        terms = []
        for sample, target in zip(head, targets, strict=True):
            for crop in sample:
                logits = [s / tau for s in crop]
                top = max(logits)
                lse = top + math.log(sum(math.exp(x - top) for x in logits))
                terms.append(lse - logits[target])
        heads.append(sum(terms) / len(terms))
    return sum(heads) / len(heads)


def test_matches_the_float64_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = [torch.randn(5, 3, k, generator=generator, dtype=torch.float64) for k in (4, 7)]
    assignments = torch.stack([torch.randint(4, (5,), generator=generator),
                               torch.randint(7, (5,), generator=generator)])
    loss = DeepClusterLoss(0.1)(scores, assignments)
    expected = _reference([s.tolist() for s in scores], assignments.tolist(), 0.1)
    assert abs(float(loss) - expected) < 1e-12


def test_bad_settings_fail() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        DeepClusterLoss(0.0)
    with pytest.raises(ValueError, match="2 heads of scores but 1 rows"):
        DeepClusterLoss()([torch.zeros(2, 2, 3)] * 2, torch.zeros(1, 2, dtype=torch.long))
