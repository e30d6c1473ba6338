"""The BYOL loss against Eq. (2) of the paper and under bf16 autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_lightning.losses import BYOLLoss


def byol_reference(p1, p2, z1, z2) -> float:  # type: ignore[no-untyped-def]
    """||p̄1 − z̄2||² + ||p̄2 − z̄1||², each averaged over the batch, sample by sample."""
    def mse(p, z):  # type: ignore[no-untyped-def]
        return np.mean([np.sum((a / np.linalg.norm(a) - b / np.linalg.norm(b)) ** 2)
                        for a, b in zip(p, z, strict=True)])
    return float(mse(p1, z2) + mse(p2, z1))


def test_byol_loss_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    p1, p2, z1, z2 = (torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(4))
    loss = BYOLLoss()(p1, p2, z1, z2)
    assert loss.item() == pytest.approx(byol_reference(*(t.numpy() for t in (p1, p2, z1, z2))),
                                        rel=1e-6)


def test_byol_loss_closed_forms_and_stop_gradient() -> None:
    z = torch.randn(4, 6)
    assert BYOLLoss()(z, z, z, z).item() == pytest.approx(0.0, abs=1e-6)  # aligned: 0
    assert BYOLLoss()(z, z, -z, -z).item() == pytest.approx(8.0, abs=1e-5)  # opposite: 2·4
    p1, p2 = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    z1, z2 = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    BYOLLoss()(p1, p2, z1, z2).backward()
    assert p1.grad is not None and p2.grad is not None
    assert z1.grad is None and z2.grad is None


def test_byol_loss_under_bf16_autocast_matches_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 16, generator=g)
    x1, x2, z1, z2 = (torch.randn(8, 16, generator=g) for _ in range(4))
    reference = BYOLLoss()(x1 @ w, x2 @ w, z1, z2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = BYOLLoss()(x1 @ w, x2 @ w, z1, z2)
    assert loss.dtype == torch.float32  # computed in fp32 (a bf16 computation returns bf16)
    assert loss.item() == pytest.approx(reference.item(), rel=5e-3)  # bf16 input rounding
