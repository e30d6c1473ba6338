"""The FastSiam loss against a float64 loop reference of Pototzky et al. §3; the known-bad target
that includes the view itself is caught by the same comparison; two views are SimSiam."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_references import cos, randn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import FastSiamLoss, NegativeCosineLoss
from ssl_lightning.methods import FastSiam

B, D = 4, 5


def fastsiam_reference(p: np.ndarray, z: np.ndarray, include_self: bool = False) -> float:
    """Pototzky et al. §3: (1/K) Σ_i −cos(p_i, (1/(K−1)) Σ_{j≠i} z_j), mean over samples."""
    views, batch = p.shape[:2]
    total = 0.0
    for i in range(views):
        others = [j for j in range(views) if include_self or j != i]
        for b in range(batch):
            total -= cos(p[i, b], sum(z[j, b] for j in others) / len(others))
    return total / (views * batch)


@pytest.mark.parametrize("views", [3, 4])
def test_fastsiam_loss_equals_the_loop(views: int) -> None:
    g = torch.Generator().manual_seed(views)
    p, z = randn(g, views, B, D).requires_grad_(), randn(g, views, B, D).requires_grad_()
    loss = FastSiamLoss()(list(p), list(z))
    assert float(loss) == pytest.approx(fastsiam_reference(p.detach().numpy(),
                                                           z.detach().numpy()), rel=1e-12)
    bad = fastsiam_reference(p.detach().numpy(), z.detach().numpy(), include_self=True)
    assert abs(bad - float(loss)) > 1e-3  # the target with the view itself is another loss
    loss.backward()
    assert z.grad is None and p.grad is not None  # stop-gradient on the targets


def test_fastsiam_with_two_views_is_simsiam() -> None:
    g = torch.Generator().manual_seed(1)
    p1, p2, z1, z2 = (randn(g, B, D) for _ in range(4))
    torch.testing.assert_close(FastSiamLoss()([p1, p2], [z1, z2]),
                               NegativeCosineLoss()(p1, p2, z1, z2), rtol=1e-14, atol=1e-14)


def test_fastsiam_refuses_fewer_than_two_views() -> None:
    with pytest.raises(ValueError, match="K >= 2"):
        FastSiamLoss()([torch.randn(B, D)], [torch.randn(B, D)])
    with pytest.raises(ValueError, match="num_views >= 2 .* got 1"):
        FastSiam(SmallConvNet((4, 8)), num_views=1)
    model = FastSiam(SmallConvNet((4, 8)), num_views=3, projection_hidden_dim=8,
                     projection_dim=D, predictor_hidden_dim=8)
    with pytest.raises(ValueError, match="needs 3 views per sample, got 2"):
        model.training_loss([torch.randn(B, 3, 8, 8)] * 2)
