"""ResNet backbone (torchvision's, without its classifier), with the CIFAR stem option.

The CIFAR stem (3×3 conv, stride 1, no max-pool) follows the SimCLR paper's CIFAR-10 setup
(Chen et al., 2020, Appendix B.9).
"""

from __future__ import annotations

from typing import Literal

import torch
import torchvision
from torch import Tensor, nn

from ssl_lightning.backbones.channels import set_input_channels
from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.spec import remember_init_args


class ResNet(nn.Module):
    """torchvision ResNet without its classifier; outputs pooled features (B, num_features).

    Args:
        depth: 18, 34 or 50.
        cifar_stem: Replace the 7×7/stride-2 conv and max-pool with a 3×3/stride-1 conv (for 32 px).
        zero_init_residual: Zero-init the last BN of each residual block (Goyal et al., 2017).
        norm: ``"batch"`` (default), or ``"group"`` (GroupNorm, 32 groups) for BN-free training.
        pretrained_path: A local state-dict file to start from (torchvision ResNet keys, or our
            export); see :mod:`ssl_lightning.backbones.pretrained`.
        in_chans: Channels of the input images (e.g. 4 or 13 bands; the first convolution reads
            them).
    """

    def __init__(
        self,
        depth: Literal[18, 34, 50] = 18,
        cifar_stem: bool = False,
        zero_init_residual: bool = False,
        norm: Literal["batch", "group"] = "batch",
        pretrained_path: str | None = None,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        remember_init_args(self, locals())
        builders = {18: torchvision.models.resnet18, 34: torchvision.models.resnet34,
                    50: torchvision.models.resnet50}
        if depth not in builders:
            raise ValueError(f"ResNet depth must be one of {sorted(builders)}, got {depth}.")
        norm_layer = None if norm == "batch" else (lambda c: nn.GroupNorm(32, c))
        net = builders[depth](
            weights=None, zero_init_residual=zero_init_residual, norm_layer=norm_layer
        )
        if cifar_stem:
            net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()  # type: ignore[assignment]
        set_input_channels(net, in_chans)
        self.num_features: int = net.fc.in_features
        net.fc = nn.Identity()  # type: ignore[assignment]
        self.net = net
        if pretrained_path is not None:
            load_pretrained(self.net, pretrained_path)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def forward_dense(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The ``layer4`` map (B, num_features, h, w) and its average-pooled features
        (:mod:`ssl_lightning.backbones.dense`)."""
        net = self.net
        x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        feature_map = net.layer4(net.layer3(net.layer2(net.layer1(x))))
        return feature_map, torch.flatten(net.avgpool(feature_map), 1)

    def forward_features(self, x: Tensor) -> Tensor:
        """The ``layer4`` feature map (B, num_features, h, w)."""
        return self.forward_dense(x)[0]
