"""Feature-size inference shared by methods and evaluation: one place for every backbone."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def feature_dim(backbone: nn.Module, image_size: int = 32) -> int:
    """The backbone's output size: its ``num_features`` attribute, else one dummy forward pass."""
    dim = getattr(backbone, "num_features", None)
    if isinstance(dim, int):
        return dim
    was_training = backbone.training
    backbone.eval()
    try:
        out = backbone(torch.zeros(2, 3, image_size, image_size))
    finally:
        backbone.train(was_training)
    if out.dim() != 2:
        raise ValueError(
            f"The backbone must return (B, D) features; it returned shape {tuple(out.shape)}. "
            "Remove its classifier/pooling mismatch or wrap it so it flattens its output."
        )
    return int(out.shape[1])
