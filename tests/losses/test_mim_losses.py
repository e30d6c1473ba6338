"""MAELoss and IJEPALoss against references written from the papers' formulas (float64 loops)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_lightning.losses import IJEPALoss, MAELoss


def _mae_reference(pred: np.ndarray, patches: np.ndarray, norm_pix: bool) -> float:
    """Mean over samples, masked patches and pixels of the squared error (He et al. §3)."""
    total, count = 0.0, 0
    for b in range(pred.shape[0]):
        for j in range(pred.shape[1]):
            target = patches[b, j].copy()
            if norm_pix:
                mean = target.sum() / len(target)
                var = ((target - mean) ** 2).sum() / (len(target) - 1)  # unbiased, as the code
                target = (target - mean) / np.sqrt(var + 1e-6)
            for k in range(len(target)):
                total += (pred[b, j, k] - target[k]) ** 2
                count += 1
    return total / count


@pytest.mark.parametrize("norm_pix", [True, False])
def test_mae_loss_equals_the_loop_reference(norm_pix: bool) -> None:
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(3, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    patches = 2.0 + 3.0 * torch.randn(3, 5, 12, generator=g, dtype=torch.float64)
    loss = MAELoss(norm_pix_loss=norm_pix)(pred, patches)
    expected = _mae_reference(pred.detach().numpy(), patches.numpy(), norm_pix)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected) < 1e-12
    loss.backward()
    assert pred.grad is not None


def _layer_norm(v: np.ndarray) -> np.ndarray:
    mean = v.mean()
    return (v - mean) / np.sqrt(((v - mean) ** 2).mean() + 1e-5)


@pytest.mark.parametrize("distance", ["mse", "smooth_l1"])
def test_ijepa_loss_equals_the_reference_and_stops_target_gradients(distance: str) -> None:
    g = torch.Generator().manual_seed(1)
    pred = (1.5 * torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)).requires_grad_()
    targets = (5.0 + 2.0 * torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
               ).requires_grad_()
    loss = IJEPALoss(distance)(pred, targets)
    total, count = 0.0, 0
    p, t = pred.detach().numpy(), targets.detach().numpy()
    for b in range(2):
        for m in range(4):
            for j in range(3):
                target = _layer_norm(t[b, m, j])  # LayerNorm over D, no affine
                for d in range(8):
                    diff = p[b, m, j, d] - target[d]
                    if distance == "mse":
                        total += diff ** 2
                    else:  # Huber with beta 1
                        total += 0.5 * diff ** 2 if abs(diff) < 1 else abs(diff) - 0.5
                    count += 1
    assert abs(loss.item() - total / count) < 1e-12
    loss.backward()
    assert pred.grad is not None and targets.grad is None


def test_losses_refuse_mismatched_shapes_and_bad_options() -> None:
    with pytest.raises(ValueError, match="same shape"):
        MAELoss()(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="same shape"):
        IJEPALoss()(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 2, 8))
    with pytest.raises(ValueError, match="distance"):
        IJEPALoss("l1")  # type: ignore[arg-type]
