"""Projection and prediction heads.

The MLP layout follows SimCLR (Chen et al., 2020, §2.1: a 2-layer MLP projection head with
BatchNorm in the v2 recipe) and BYOL (Grill et al., 2020, §3.3: Linear-BN-ReLU-Linear).
"""

from __future__ import annotations

from torch import nn


def build_mlp(
    in_dim: int,
    hidden_dim: int,
    out_dim: int,
    num_layers: int = 2,
    batch_norm: bool = True,
    last_batch_norm: bool = False,
    last_bias: bool = True,
    activation: type[nn.Module] = nn.ReLU,
) -> nn.Sequential:
    """Linear-(BN)-act blocks followed by a final Linear (optionally with an affine-free BN).

    Args:
        in_dim: Input feature size.
        hidden_dim: Width of the hidden layers.
        out_dim: Output size.
        num_layers: Number of Linear layers (>= 1).
        batch_norm: BatchNorm1d after each hidden Linear.
        last_batch_norm: Affine-free BatchNorm1d after the last Linear (SimCLR v2, MoCo v3).
        last_bias: Bias on the last Linear.
        activation: Activation class between layers.
    """
    if num_layers < 1:
        raise ValueError(f"An MLP needs num_layers >= 1, got {num_layers}.")
    layers: list[nn.Module] = []
    dim = in_dim
    for _ in range(num_layers - 1):
        layers.append(nn.Linear(dim, hidden_dim, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(activation())
        dim = hidden_dim
    layers.append(nn.Linear(dim, out_dim, bias=last_bias and not last_batch_norm))
    if last_batch_norm:
        layers.append(nn.BatchNorm1d(out_dim, affine=False))
    return nn.Sequential(*layers)


class ProjectionHead(nn.Module):
    """MLP projection head g(·) mapping backbone features to the loss space.

    Args:
        in_dim: Backbone feature size.
        hidden_dim: Hidden width (2048 in SimCLR; 512 is enough for CIFAR ResNet-18).
        out_dim: Embedding size (128 in SimCLR).
        num_layers: Number of Linear layers.
        batch_norm: BatchNorm in the hidden layers. Turn off for BatchNorm-free models, e.g. the
            exact-DDP tests, since BatchNorm statistics are per rank.
        last_batch_norm: Affine-free BatchNorm on the output.
    """

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int = 2048,
        out_dim: int = 128,
        num_layers: int = 2,
        batch_norm: bool = True,
        last_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.mlp = build_mlp(
            in_dim, hidden_dim, out_dim, num_layers, batch_norm, last_batch_norm=last_batch_norm
        )

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.mlp(x)


class PredictionHead(ProjectionHead):
    """MLP predictor q(·) on the online/query branch of BYOL (Grill et al., 2020, §3.3:
    Linear(4096)-BN-ReLU-Linear(256)) and MoCo v3 (Chen, Xie & He, ICCV 2021, §4: 2 layers with
    an affine-free BN on the output). Same layout and arguments as :class:`ProjectionHead`; maps
    the projection space to itself by default.
    """

    def __init__(
        self,
        in_dim: int = 256,
        hidden_dim: int = 4096,
        out_dim: int = 256,
        num_layers: int = 2,
        batch_norm: bool = True,
        last_batch_norm: bool = False,
    ) -> None:
        super().__init__(in_dim, hidden_dim, out_dim, num_layers, batch_norm, last_batch_norm)
