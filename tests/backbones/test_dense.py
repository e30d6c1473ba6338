"""Dense features (backbones/dense.py): map shapes, the pooled feature equal to ``forward``, the
map equal to what it is said to be (the pooled map for CNNs, the patch tokens for ViTs)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ssl_lightning.backbones import ResNet, SmallConvNet, TimmBackbone, TorchvisionBackbone, ViT
from ssl_lightning.backbones.dense import dense_features

X = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("make", "shape", "pooled_is_mean"), [
    (lambda: SmallConvNet((8, 16)), (16, 4, 4), True),
    (lambda: ResNet(18, cifar_stem=True, norm="group"), (512, 2, 2), True),
    (lambda: TorchvisionBackbone("resnet18"), (512, 1, 1), True),
    (lambda: TorchvisionBackbone("mobilenet_v3_small"), (576, 1, 1), False),  # an MLP after
    (lambda: TimmBackbone("convnext_atto", model_kwargs={"depths": (1, 1, 1, 1)}), (320, 1, 1),
     False),  # 32 px (stride 32); the head has a LayerNorm
    (lambda: TimmBackbone("vit_tiny_patch16_224", model_kwargs={"img_size": 16, "depth": 1,
                                                                  "patch_size": 4}),
     (192, 4, 4), False),
    (lambda: ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2), (16, 4, 4),
     False),
])
def test_map_shape_and_pooled_feature(make, shape, pooled_is_mean) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    backbone = make().eval()
    x = X if shape[0] != 320 else torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feature_map, pooled = dense_features(backbone, x)
        assert tuple(feature_map.shape) == (2, *shape)
        torch.testing.assert_close(pooled, backbone(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(backbone.forward_features(x), feature_map, atol=1e-6, rtol=0)
        if pooled_is_mean:
            torch.testing.assert_close(pooled, feature_map.mean(dim=(2, 3)), atol=1e-5, rtol=0)


def test_vit_map_is_the_patch_grid_and_last_blocks_concatenate() -> None:
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              num_registers=1).eval()
    with torch.no_grad():
        tokens = vit.forward_tokens(X)
        feature_map, _ = vit.forward_dense(X, last_blocks=2)
        one_block = copy.deepcopy(vit)
        del one_block.blocks[1]  # its output is norm(block 0's output)
        first = one_block.forward_tokens(X)
    assert feature_map.shape == (2, 32, 4, 4)
    # row-major grid: map[:, :, i, j] is patch token i * 4 + j (after [CLS] and the register)
    torch.testing.assert_close(feature_map[:, 16:, 1, 2], tokens[:, 2 + 1 * 4 + 2], atol=0, rtol=0)
    torch.testing.assert_close(feature_map[:, :16, 3, 0], first[:, 2 + 3 * 4], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="last_blocks must be in"):
        vit.forward_dense(X, last_blocks=3)


def test_backbone_without_dense_features_is_named() -> None:
    with pytest.raises(ValueError, match="Linear has no dense features"):
        dense_features(nn.Linear(3, 4), X)


def test_torchvision_extractor_is_not_in_the_state_dict_and_follows_copies() -> None:
    backbone = TorchvisionBackbone("resnet18")
    keys = set(backbone.state_dict())
    backbone.forward_dense(X)
    assert set(backbone.state_dict()) == keys
    twin = copy.deepcopy(backbone)
    with torch.no_grad():
        next(twin.parameters()).zero_()
    assert not torch.equal(twin.forward_features(X), backbone.forward_features(X))
