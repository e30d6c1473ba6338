"""GramLoss against DINOv3's Eq. (3) written with plain loops in float64."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.losses import GramLoss


def reference(student, teacher, clamp="none", normalize=True, token_mask=None) -> float:
    """Per image: mean over the selected (i, j) of (<s_i, s_j> − <t_i, t_j>)², then mean."""
    total = 0.0
    for b in range(student.shape[0]):
        s, t = student[b].tolist(), teacher[b].tolist()
        if normalize:
            s = [[v / math.sqrt(sum(w * w for w in row)) for v in row] for row in s]
            t = [[v / math.sqrt(sum(w * w for w in row)) for v in row] for row in t]
        keep = [token_mask is None or bool(token_mask[b, i]) for i in range(len(s))]
        errors = []
        for i in range(len(s)):
            for j in range(len(s)):
                if keep[i] and keep[j]:
                    gs = sum(a * c for a, c in zip(s[i], s[j], strict=True))
                    gt = sum(a * c for a, c in zip(t[i], t[j], strict=True))
                    if clamp in ("both", "teacher"):
                        gt = max(gt, 0.0)
                    if clamp == "both":
                        gs = max(gs, 0.0)
                    errors.append((gs - gt) ** 2)
        total += sum(errors) / len(errors) if errors else 0.0
    return total / student.shape[0]


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 5, 4, generator=g, dtype=torch.float64) * 3
    teacher = torch.randn(3, 5, 6, generator=g, dtype=torch.float64) * 0.5
    return student, teacher


@pytest.mark.parametrize("clamp", ["none", "both", "teacher"])
def test_matches_equation_float64(tokens, clamp):
    student, teacher = tokens
    loss = GramLoss(clamp_negatives=clamp)(student, teacher)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - reference(student, teacher, clamp)) < 1e-12


def test_token_mask_per_image(tokens):
    student, teacher = tokens
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    loss = GramLoss()(student, teacher, mask)
    assert abs(loss.item() - reference(student, teacher, token_mask=mask)) < 1e-12


def test_unnormalised_tokens_differ_from_the_equation(tokens):
    """Known-bad: Gram of raw tokens. The option exists (official normalized: false) but is
    not the paper's equation; the reference tells them apart."""
    student, teacher = tokens
    raw = GramLoss(normalize=False)(student, teacher).item()
    assert abs(raw - reference(student, teacher, normalize=False)) < 1e-9
    assert abs(raw - reference(student, teacher)) > 1e-3


def test_properties_and_gradient(tokens):
    student, teacher = tokens
    loss_fn = GramLoss()
    # Invariant to the tokens' scale and to a common rotation of the feature space.
    q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))
    assert torch.allclose(loss_fn(student, student * 7 @ q), torch.zeros((), dtype=torch.float64),
                          atol=1e-12)
    student = student.requires_grad_()
    loss_fn(student, teacher.requires_grad_()).backward()
    assert student.grad is not None and teacher.grad is None
    assert torch.autograd.gradcheck(lambda s: loss_fn(s, teacher.detach()), (student,))


def test_bad_shapes_name_the_fix():
    with pytest.raises(ValueError, match="resize"):
        GramLoss()(torch.randn(2, 4, 3), torch.randn(2, 16, 3))
    with pytest.raises(ValueError, match="clamp_negatives"):
        GramLoss(clamp_negatives="student")  # type: ignore[arg-type]
