"""Backbones: ResNet (with the CIFAR stem option) and a small BatchNorm-free ConvNet.

Any ``nn.Module`` that maps images to a (B, D) feature tensor works as a backbone; these
classes exist so that configs can name them. The CIFAR stem (3×3 conv, stride 1, no max-pool)
follows the SimCLR paper's CIFAR-10 setup (Chen et al., 2020, Appendix B.9).
"""

from __future__ import annotations

from typing import Literal

import torch
import torchvision
from torch import Tensor, nn

from ssl_lightning.vit import ViT

__all__ = ["ResNet", "SmallConvNet", "TorchvisionBackbone", "ViT", "feature_dim"]


class ResNet(nn.Module):
    """torchvision ResNet without its classifier; outputs pooled features (B, num_features).

    Args:
        depth: 18, 34 or 50.
        cifar_stem: Replace the 7×7/stride-2 conv and max-pool with a 3×3/stride-1 conv (for 32 px).
        zero_init_residual: Zero-init the last BN of each residual block (Goyal et al., 2017).
        norm: ``"batch"`` (default), or ``"group"`` (GroupNorm, 32 groups) for BN-free training.
    """

    def __init__(
        self,
        depth: Literal[18, 34, 50] = 18,
        cifar_stem: bool = False,
        zero_init_residual: bool = False,
        norm: Literal["batch", "group"] = "batch",
    ) -> None:
        super().__init__()
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
        self.num_features: int = net.fc.in_features
        net.fc = nn.Identity()  # type: ignore[assignment]
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SmallConvNet(nn.Module):
    """A few conv layers with GroupNorm (or no norm) and global average pooling.

    Fast on CPU and free of BatchNorm, so its outputs for a sample do not depend on the rest of
    the batch: used by the exact-DDP tests and for short CPU smoke runs.

    Args:
        widths: Channels of each stride-2 conv stage.
        norm: ``"group"`` (GroupNorm with 8 groups) or ``"none"``.
    """

    def __init__(
        self, widths: tuple[int, ...] = (32, 64, 128), norm: Literal["group", "none"] = "group"
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in widths:
            layers.append(nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=norm == "none"))
            if norm == "group":
                layers.append(nn.GroupNorm(min(8, width), width))
            layers.append(nn.ReLU(inplace=True))
            channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.net = nn.Sequential(*layers)
        self.num_features: int = channels

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TorchvisionBackbone(nn.Module):
    """Any torchvision classification model, by name, with its final classifier Linear removed.

    The last ``nn.Linear`` of the model's ``fc`` / ``classifier`` / ``heads`` / ``head`` is replaced
    by ``nn.Identity``, so the output is the penultimate features (ResNet-50: 2048, ConvNeXt-T:
    768, MobileNetV3-S: 1024, ...). Weights start random (SSL pre-training from scratch).

    Args:
        name: A ``torchvision.models.get_model`` name, e.g. ``"resnet50"``, ``"convnext_tiny"``.
        cifar_stem: For models with ``conv1`` and ``maxpool`` (ResNet family): 3×3/stride-1 first
            convolution and no max-pool, for 32 px images.
    """

    def __init__(self, name: str = "resnet18", cifar_stem: bool = False) -> None:
        super().__init__()
        if name not in torchvision.models.list_models(module=torchvision.models):
            raise ValueError(
                f"Unknown torchvision classification model {name!r}; see "
                "torchvision.models.list_models(module=torchvision.models)."
            )
        net = torchvision.models.get_model(name, weights=None)
        _drop_classifier(net, name)
        if cifar_stem:
            conv1 = getattr(net, "conv1", None)
            if not isinstance(conv1, nn.Conv2d) or not hasattr(net, "maxpool"):
                raise ValueError(
                    f"cifar_stem needs a model with conv1 and maxpool; {name} has none."
                )
            net.conv1 = nn.Conv2d(3, conv1.out_channels, 3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _drop_classifier(net: nn.Module, name: str) -> None:
    """Replace the last Linear of the model's classifier attribute with Identity, in place."""
    for attribute in ("fc", "classifier", "heads", "head"):
        head = getattr(net, attribute, None)
        if isinstance(head, nn.Linear):
            setattr(net, attribute, nn.Identity())
            return
        if isinstance(head, nn.Sequential):
            linear_names = [n for n, m in head.named_children() if isinstance(m, nn.Linear)]
            if linear_names:
                setattr(head, linear_names[-1], nn.Identity())
                return
    raise ValueError(
        f"Cannot find the classifier of torchvision model {name!r} (looked for a Linear in fc, "
        "classifier, heads, head); wrap the model yourself so it returns (B, D) features."
    )


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
