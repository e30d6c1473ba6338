"""A small BatchNorm-free ConvNet for exact-DDP tests and CPU smoke runs."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from ssl_lightning.backbones.channels import check_in_chans
from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.spec import remember_init_args


class SmallConvNet(nn.Module):
    """A few conv layers with GroupNorm (or no norm) and global average pooling.

    Fast on CPU and free of BatchNorm, so its outputs for a sample do not depend on the rest of
    the batch: used by the exact-DDP tests and for short CPU smoke runs.

    Args:
        widths: Channels of each stride-2 conv stage.
        norm: ``"group"`` (GroupNorm with 8 groups) or ``"none"``.
        pretrained_path: A local state-dict file to start from (our export); see
            :mod:`ssl_lightning.backbones.pretrained`.
        in_chans: Channels of the input images.
    """

    def __init__(
        self,
        widths: tuple[int, ...] = (32, 64, 128),
        norm: Literal["group", "none"] = "group",
        pretrained_path: str | None = None,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        remember_init_args(self, locals())
        check_in_chans(in_chans)
        layers: list[nn.Module] = []
        channels = in_chans
        for width in widths:
            layers.append(nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=norm == "none"))
            if norm == "group":
                layers.append(nn.GroupNorm(min(8, width), width))
            layers.append(nn.ReLU(inplace=True))
            channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.net = nn.Sequential(*layers)
        self.num_features: int = channels
        if pretrained_path is not None:
            load_pretrained(self, pretrained_path)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def forward_dense(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The last stage's map (B, num_features, h, w) and its average-pooled features
        (:mod:`ssl_lightning.backbones.dense`)."""
        feature_map = self.net[:-2](x)
        return feature_map, self.net[-2:](feature_map)

    def forward_features(self, x: Tensor) -> Tensor:
        """The last stage's feature map (B, num_features, h, w)."""
        return self.net[:-2](x)
