"""Backbones: ResNet, a small ConvNet, torchvision and timm models by name, a ViT.

Any ``nn.Module`` that maps images to a (B, D) feature tensor works as a backbone; these
classes exist so that configs can name them (``class_path: ssl_lightning.ResNet``).
"""

from ssl_lightning.backbones.features import feature_dim
from ssl_lightning.backbones.resnet import ResNet
from ssl_lightning.backbones.small import SmallConvNet
from ssl_lightning.backbones.spec import backbone_spec, build_backbone
from ssl_lightning.backbones.timm_models import TimmBackbone
from ssl_lightning.backbones.torchvision_models import TorchvisionBackbone
from ssl_lightning.backbones.vit import ViT

__all__ = [
    "ResNet", "SmallConvNet", "TimmBackbone", "TorchvisionBackbone", "ViT",
    "backbone_spec", "build_backbone", "feature_dim",
]
