"""Linear heads on a frozen patch-feature map: BatchNorm + 1×1 convolution (DINOv2/DINOv3's
linear segmentation and depth heads), one per learning rate of the grid."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


class LinearDenseHead(nn.Sequential):
    """BatchNorm over the channels, then a 1×1 convolution to ``out_channels`` maps."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)
        nn.init.normal_(conv.weight, std=0.01)
        nn.init.zeros_(conv.bias)  # type: ignore[arg-type]
        super().__init__(nn.BatchNorm2d(in_channels), conv)


class HeadGrid(nn.ModuleList):
    """One :class:`LinearDenseHead` per learning rate; all read the same features."""

    def __init__(self, in_channels: int, out_channels: int, lrs: Sequence[float]) -> None:
        if not lrs or min(lrs) <= 0:
            raise ValueError(f"lrs must be a non-empty list of values > 0, got {list(lrs)}.")
        super().__init__([LinearDenseHead(in_channels, out_channels) for _ in lrs])
        self.lrs = list(lrs)

    def forward(self, features: Tensor) -> list[Tensor]:  # type: ignore[override]
        """Every head's output map on ``features`` (B, C, h, w)."""
        return [head(features) for head in self]

    def names(self) -> list[str]:
        """Metric-name suffixes of the heads: ``lr<value>``."""
        return [f"lr{lr:g}" for lr in self.lrs]
