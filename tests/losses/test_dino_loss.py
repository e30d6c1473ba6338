"""DINO loss vs the paper's formula (float64 loops), centre update, autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_lightning.losses import DINOLoss


def log_softmax_np(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def dino_reference(student, teacher, center, tau_s, tau_t):
    """Caron et al. 2021, Eq. (3) over crop pairs: mean_b Σ_{t} Σ_{s≠t} H(P_t, P_s) / n_pairs."""
    total, pairs = 0.0, 0
    for t_idx, t in enumerate(teacher):
        p_t = np.exp(log_softmax_np((t - center) / tau_t))
        for s_idx, s in enumerate(student):
            if s_idx == t_idx:
                continue
            log_p_s = log_softmax_np(s / tau_s)
            per_sample = [-sum(p_t[b, k] * log_p_s[b, k] for k in range(t.shape[1]))
                          for b in range(t.shape[0])]
            total += np.mean(per_sample)
            pairs += 1
    return total / pairs


def crops(n_student=5, n_teacher=2, b=4, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = [torch.randn(b, k, generator=g, dtype=torch.float64).float()
               for _ in range(n_student)]
    teacher = [torch.randn(b, k, generator=g, dtype=torch.float64).float()
               for _ in range(n_teacher)]
    return student, teacher


def test_multicrop_loss_and_centre_match_reference():
    student, teacher = crops()
    loss_fn = DINOLoss(6, student_temperature=0.1, center_momentum=0.9)
    old_center = torch.linspace(-0.5, 0.5, 6).unsqueeze(0)
    loss_fn.center.copy_(old_center)
    loss = loss_fn(student, teacher, teacher_temperature=0.04)
    np_s = [s.double().numpy() for s in student]
    np_t = [t.double().numpy() for t in teacher]
    # The loss uses the centre from *before* this batch.
    expected = dino_reference(np_s, np_t, old_center.double().numpy(), 0.1, 0.04)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # Centre after the loss: 0.9·c + 0.1·mean over both crops and all samples.
    new_center = 0.9 * old_center + 0.1 * torch.cat(teacher).mean(dim=0, keepdim=True)
    torch.testing.assert_close(loss_fn.center, new_center)
    assert loss_fn.center.dtype == torch.float32


def test_two_crops_equal_algorithm_1():
    student, teacher = crops(n_student=2)
    loss_fn = DINOLoss(6)

    def h(t, s):  # Algorithm 1: H(t, s) with C = 0, tps = 0.1, tpt = 0.04
        return -(torch.softmax(t / 0.04, 1) * torch.log_softmax(s / 0.1, 1)).sum(1).mean()

    expected = h(teacher[0], student[1]) / 2 + h(teacher[1], student[0]) / 2
    torch.testing.assert_close(loss_fn(student, teacher, 0.04), expected)


def test_gradient_reaches_the_student_only():
    student, teacher = crops()
    student = [s.requires_grad_() for s in student]
    teacher = [t.requires_grad_() for t in teacher]
    DINOLoss(6)(student, teacher, 0.07).backward()
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in student)
    assert all(t.grad is None for t in teacher)


def test_centre_is_frozen_in_eval_and_persistent():
    student, teacher = crops()
    loss_fn = DINOLoss(6).eval()
    loss_fn(student, teacher, 0.04)
    assert torch.equal(loss_fn.center, torch.zeros(1, 6))
    assert "center" in loss_fn.state_dict()


def test_bf16_inputs_under_autocast_computed_in_fp32():
    student, teacher = crops(k=64)
    student16 = [s.bfloat16() for s in student]
    teacher16 = [t.bfloat16() for t in teacher]
    reference = DINOLoss(64)(
        [s.float() for s in student16], [t.float() for t in teacher16], 0.04
    )
    loss_fn = DINOLoss(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(student16, teacher16, 0.04)
    assert loss.dtype == torch.float32 and loss_fn.center.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs", [dict(out_dim=0), dict(student_temperature=0.0), dict(center_momentum=1.0)]
)
def test_invalid_arguments(kwargs):
    args = dict(out_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError):
        DINOLoss(**args)


def test_invalid_call():
    student, teacher = crops()
    with pytest.raises(ValueError, match="teacher_temperature"):
        DINOLoss(6)(student, teacher, 0.0)
    with pytest.raises(ValueError, match="student crops"):
        DINOLoss(6)(student[:1], teacher, 0.04)
