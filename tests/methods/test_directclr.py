"""DirectCLR: NT-Xent (a float64 loop reference of SimCLR's Eq. 1) on the backbone's leading
feature dimensions only; the other dimensions get no gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loss_references import cos, randn
from torch import nn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import DirectCLR

B = 4


def nt_xent_reference(z1: np.ndarray, z2: np.ndarray, t: float) -> float:
    """SimCLR Eq. (1) over the 2B anchors: −log e^{s(a,pos)/T} / Σ_{k≠a} e^{s(a,k)/T}."""
    z = np.concatenate([z1, z2])
    n = len(z1)
    total = 0.0
    for a in range(2 * n):
        positive = (a + n) % (2 * n)
        denominator = sum(math.exp(cos(z[a], z[k]) / t) for k in range(2 * n) if k != a)
        total -= math.log(math.exp(cos(z[a], z[positive]) / t) / denominator)
    return total / (2 * n)


def test_directclr_is_nt_xent_on_the_leading_feature_dims() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 12))
    model = DirectCLR(backbone, loss_dim=5, temperature=0.3, image_size=4).double()
    g = torch.Generator().manual_seed(3)
    views = [randn(g, B, 3, 4, 4) for _ in range(2)]
    loss, features = model.training_loss(views)
    with torch.no_grad():
        r1, r2 = (backbone(v).numpy() for v in views)
    assert float(loss) == pytest.approx(nt_xent_reference(r1[:, :5], r2[:, :5], 0.3), rel=1e-12)
    assert features.shape == (B, 12)
    loss.backward()
    weight_grad = backbone[1].weight.grad
    assert weight_grad[:5].abs().sum() > 0 and weight_grad[5:].abs().sum() == 0


def test_directclr_refuses_more_dims_than_the_backbone_has() -> None:
    with pytest.raises(ValueError, match=r"loss_dim must be in \[1, 8\].*got 9"):
        DirectCLR(SmallConvNet((4, 8)), loss_dim=9)
