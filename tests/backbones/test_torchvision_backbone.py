"""TorchvisionBackbone: any torchvision classifier becomes a (B, D) feature extractor."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from ssl_lightning import SimCLR, TorchvisionBackbone
from ssl_lightning.backbones import feature_dim


def test_resnet18_features_equal_torchvision_penultimate_layer() -> None:
    torch.manual_seed(0)
    backbone = TorchvisionBackbone("resnet18").eval()
    reference = torchvision.models.resnet18()
    reference.load_state_dict(backbone.net.state_dict(), strict=False)  # fc weights stay random
    reference.fc = nn.Identity()
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(backbone(x), reference.eval()(x))
    assert feature_dim(backbone, 64) == 512


def test_sequential_classifier_loses_only_its_last_linear() -> None:
    backbone = TorchvisionBackbone("mobilenet_v3_small")
    assert isinstance(backbone.net.classifier[-1], nn.Identity)
    assert isinstance(backbone.net.classifier[0], nn.Linear)  # the hidden Linear stays
    assert feature_dim(backbone, 32) == 1024


def test_cifar_stem_keeps_32px_resolution_through_the_stem() -> None:
    backbone = TorchvisionBackbone("resnet18", cifar_stem=True)
    assert backbone.net.conv1.stride == (1, 1) and isinstance(backbone.net.maxpool, nn.Identity)
    method = SimCLR(backbone, projection_hidden_dim=16, projection_dim=8)
    assert method.feature_dim == 512


def test_bad_names_and_stems_are_explained() -> None:
    with pytest.raises(ValueError, match="Unknown torchvision classification model 'resnet19'"):
        TorchvisionBackbone("resnet19")
    with pytest.raises(ValueError, match="cifar_stem needs a model with conv1"):
        TorchvisionBackbone("mobilenet_v3_small", cifar_stem=True)
