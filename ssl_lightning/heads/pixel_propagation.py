"""PixPro's pixel propagation module (PPM): Xie, Lin, Zhang, Cao, Lin & Hu, "Propagate Yourself:
Exploring Pixel-Level Consistency for Unsupervised Visual Representation Learning", CVPR 2021,
§3.2, Eqs. (2)-(3).

Every location i of a feature map gets the smoothed feature
``y_i = Σ_j s(x_i, x_j) · g(x_j)`` over the locations j of the same map, with the similarity
``s(x_i, x_j) = max(cos(x_i, x_j), 0)^γ`` (γ = 2, the sharpness) and a transform g of
``layers`` layers (0: the identity; 1: one linear layer, the paper's choice by its ablation;
2: a Linear-BN-ReLU-Linear MLP of the same width). As in the authors' code
(``contrast/models/PixPro.py``, ``featprop``), g's outputs are L2-normalised per location before
they are summed. The similarity and the weighted sum run in fp32 outside autocast (float64 for
float64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.heads.mlp import build_mlp
from ssl_lightning.losses.numerics import at_least_fp32

#: Added to the similarities when γ < 1 (the authors' code does the same): the gradient of
#: ``s^γ`` at s = 0 is then finite.
SMALL_GAMMA_EPS = 1e-6


class PixelPropagation(nn.Module):
    """The PPM on location sequences (B, N, C) (a map in row-major order,
    :func:`~ssl_lightning.losses.dense_matching.map_to_locations`).

    Args:
        dim: Channels C of the locations (the projection size, 256 in PixPro).
        gamma: γ, the exponent of the similarity (2).
        layers: Layers of the transform g (1; 0: identity; 2: Linear-BN-ReLU-Linear).
        batch_norm: BatchNorm in g's hidden layer (``layers`` = 2 only), over all locations of
            the batch.
    """

    def __init__(self, dim: int, gamma: float = 2.0, layers: int = 1,
                 batch_norm: bool = True) -> None:
        super().__init__()
        if gamma <= 0:
            raise ValueError(f"gamma (the similarity's exponent) must be > 0, got {gamma}.")
        if layers not in (0, 1, 2):
            raise ValueError(f"layers of the transform g must be 0, 1 or 2, got {layers}.")
        self.gamma = gamma
        self.transform: nn.Module = nn.Identity() if layers == 0 else build_mlp(
            dim, dim, dim, num_layers=layers, batch_norm=batch_norm)

    def similarity(self, locations: Tensor) -> Tensor:
        """``s(x_i, x_j) = max(cos(x_i, x_j), 0)^γ`` of every pair of a sample's locations,
        (B, N, N), in fp32 (float64 for float64 inputs)."""
        with torch.autocast(device_type=locations.device.type, enabled=False):
            x = F.normalize(at_least_fp32(locations), dim=2)
            s = (x @ x.transpose(1, 2)).clamp(min=0)
            if self.gamma < 1:
                s = s + SMALL_GAMMA_EPS
            return s.pow(self.gamma)

    def forward(self, locations: Tensor) -> Tensor:
        """The propagated features ``y`` (B, N, C) of ``locations`` (B, N, C)."""
        if locations.dim() != 3:
            raise ValueError(f"Expected locations (B, N, C), got {tuple(locations.shape)}.")
        values = self.transform(locations.flatten(0, 1)).unflatten(0, locations.shape[:2])
        similarity = self.similarity(locations)
        with torch.autocast(device_type=locations.device.type, enabled=False):
            values = F.normalize(at_least_fp32(values).to(similarity.dtype), dim=2)
            return similarity @ values
