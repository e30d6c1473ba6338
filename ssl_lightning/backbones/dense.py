"""Dense features: a backbone's spatial feature map besides its pooled feature.

A dense backbone has ``forward_dense(x) -> (feature_map, pooled)``: the map (B, C, h, w) of the
last stage (a CNN's last convolution block before pooling, a ViT's patch tokens on their grid)
and the pooled (B, D) feature that ``forward(x)`` returns, from one forward pass; and
``forward_features(x)``, the map alone. Every backbone of :mod:`ssl_lightning.backbones` has
both. Distillation's local terms use them (and later Gram anchoring and dense methods).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import Tensor, nn


class DenseBackbone(Protocol):
    """A backbone with a spatial feature map (see the module docstring)."""

    def forward_dense(self, x: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward_features(self, x: Tensor) -> Tensor: ...


def has_dense_features(backbone: nn.Module) -> bool:
    """Whether ``backbone`` has ``forward_dense`` (the dense-feature protocol)."""
    return callable(getattr(backbone, "forward_dense", None))


def dense_features(backbone: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(feature_map (B, C, h, w), pooled (B, D))`` of ``backbone`` on images ``x``.

    Raises:
        ValueError: ``backbone`` has no ``forward_dense`` (naming the backbones that have one),
            or it returns other shapes.
    """
    if not has_dense_features(backbone):
        raise ValueError(
            f"{type(backbone).__name__} has no dense features (forward_dense(x) -> "
            "(feature map (B, C, h, w), pooled (B, D))). Use a backbone of ssl_lightning.backbones "
            "(ResNet, SmallConvNet, TorchvisionBackbone, TimmBackbone, ViT) or add that method."
        )
    feature_map, pooled = cast(DenseBackbone, backbone).forward_dense(x)
    if feature_map.dim() != 4 or pooled.dim() != 2 or len(feature_map) != len(x):
        raise ValueError(
            f"{type(backbone).__name__}.forward_dense returned shapes {tuple(feature_map.shape)} "
            f"and {tuple(pooled.shape)}; expected (B, C, h, w) and (B, D) with B = {len(x)}."
        )
    return feature_map, pooled


def tokens_to_map(patch_tokens: Tensor, grid_h: int, grid_w: int) -> Tensor:
    """Patch tokens (B, h·w, D) in row-major grid order as a feature map (B, D, h, w)."""
    b, n, d = patch_tokens.shape
    if n != grid_h * grid_w:
        raise ValueError(f"{n} patch tokens do not fill a {grid_h}x{grid_w} grid.")
    return patch_tokens.transpose(1, 2).reshape(b, d, grid_h, grid_w)


@torch.no_grad()
def dense_channels(backbone: nn.Module, image_size: int = 32) -> int:
    """The channels C of ``backbone``'s feature map, from one forward pass in eval mode on two
    black ``image_size`` images (the mode is restored)."""
    was_training = backbone.training
    backbone.eval()
    try:
        return int(dense_features(backbone, torch.zeros(2, 3, image_size, image_size))[0].shape[1])
    finally:
        backbone.train(was_training)
