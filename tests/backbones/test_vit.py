"""ViT backbone: shapes, multi-resolution input, attention and sin-cos tables vs references."""

from __future__ import annotations

import math

import pytest
import torch
from mim_utils import SIZE
from mim_utils import tiny_vit as mim_vit

from ssl_lightning.backbones import ViT, feature_dim
from ssl_lightning.backbones.vit import Block, DropPath, sincos_position_embedding


def tiny_vit(**kwargs) -> ViT:
    torch.manual_seed(0)
    args = dict(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)
    args.update(kwargs)
    return ViT(**args)


def test_shapes_presets_and_feature_dim():
    small = ViT("small", image_size=224, patch_size=16, depth=1)
    assert small.num_features == 384 and small.blocks[0].num_heads == 6
    assert small.pos_embed.shape == (1, 14 * 14 + 1, 384)
    assert len(ViT("tiny", embed_dim=8, num_heads=2).blocks) == 12
    model = tiny_vit()
    assert feature_dim(model) == 32
    out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 32)


def test_local_crops_use_interpolated_position_embedding():
    model = tiny_vit().eval()
    x = torch.randn(2, 3, 16, 16)
    out = model(x)
    assert out.shape == (2, 32)
    pos = model.position_embedding(2, 2)
    assert pos.shape == (1, 5, 32)
    # The [CLS] position is kept; interpolation of a constant grid is the constant.
    torch.testing.assert_close(pos[:, 0], model.pos_embed[:, 0])
    with torch.no_grad():
        model.pos_embed[:, 1:] = 0.5
    torch.testing.assert_close(model.position_embedding(2, 2)[:, 1:], torch.full((1, 4, 32), 0.5))
    # The stored grid is returned unchanged at the training resolution.
    assert model.position_embedding(4, 4) is model.pos_embed


def test_position_embedding_makes_output_order_sensitive():
    model = tiny_vit().eval()
    x = torch.randn(1, 3, 32, 32)
    swapped = x.clone()
    swapped[..., :8, :8], swapped[..., 8:16, :8] = x[..., 8:16, :8], x[..., :8, :8]
    assert not torch.allclose(model(x), model(swapped))


def test_attention_matches_reference_loop():
    torch.manual_seed(1)
    block = Block(dim=12, num_heads=3, mlp_ratio=2.0, qkv_bias=True, drop_path=0.0)
    x = torch.randn(2, 5, 12)
    qkv = x @ block.qkv.weight.T + block.qkv.bias
    q, k, v = qkv[..., :12], qkv[..., 12:24], qkv[..., 24:]
    heads = []
    for h in range(3):
        sl = slice(4 * h, 4 * h + 4)
        scores = q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(4)
        heads.append(scores.softmax(-1) @ v[..., sl])
    expected = torch.cat(heads, dim=-1) @ block.proj.weight.T + block.proj.bias
    torch.testing.assert_close(block.attention(x), expected, rtol=1e-5, atol=1e-6)


def test_sincos_table_matches_formula():
    grid, dim = 3, 8
    table = sincos_position_embedding(grid, dim)
    for i in range(grid):
        for j in range(grid):
            row = table[i * grid + j]
            for c in range(dim // 4):
                omega = 1.0 / 10000 ** (c / (dim // 4))
                expected = [math.sin(j * omega), math.cos(j * omega),
                            math.sin(i * omega), math.cos(i * omega)]
                got = [row[c + q * (dim // 4)].item() for q in range(4)]
                assert got == pytest.approx(expected, abs=1e-6)
    model = tiny_vit(pos_embed="sincos")
    assert not model.pos_embed.requires_grad
    torch.testing.assert_close(model.pos_embed[0, 1:], sincos_position_embedding(4, 32))


def test_drop_path_is_per_sample_and_off_in_eval():
    torch.manual_seed(0)
    drop = DropPath(0.5)
    x = torch.ones(64, 3, 2)
    y = drop(x)
    per_sample = y.flatten(1)
    assert set(per_sample.unique().tolist()) <= {0.0, 2.0}
    assert (per_sample == per_sample[:, :1]).all()
    drop.eval()
    assert torch.equal(drop(x), x)


@pytest.mark.parametrize(
    "kwargs",
    [dict(arch="huge"), dict(image_size=30, patch_size=4), dict(embed_dim=30, num_heads=4),
     dict(drop_path_rate=1.0), dict(pos_embed="rotary"), dict(mlp="geglu"),
     dict(layer_scale_init=0.0), dict(pos_embed="rope", embed_dim=24, num_heads=4),
     dict(pos_embed="rope", rope_jitter=0.5), dict(pos_embed="rope", rope_shift=-1.0),
     dict(norm_eps=0.0)],
)
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        ViT(**kwargs)


def test_rejects_image_not_multiple_of_patch():
    with pytest.raises(ValueError, match="not a multiple of the ViT.s patch_size"):
        tiny_vit()(torch.randn(1, 3, 20, 20))


def test_forward_tokens_keep_selects_patches_with_their_positions() -> None:
    torch.manual_seed(0)
    vit = ViT(depth=2, embed_dim=32, num_heads=2).eval()
    x = torch.randn(2, 3, 16, 16)
    full = vit.forward_tokens(x)
    assert full.shape == (2, 1 + 16, 32)
    assert torch.allclose(full[:, 0], vit(x))
    perm = torch.stack([torch.randperm(16), torch.randperm(16)])
    permuted = vit.forward_tokens(x, keep=perm)  # attention is equivariant to token order
    expected = full[:, 1:].gather(1, perm.unsqueeze(-1).expand(-1, -1, 32))
    assert torch.allclose(permuted[:, 1:], expected, atol=1e-5)
    subset = vit.forward_tokens(x, keep=perm[:, :4])
    assert subset.shape == (2, 5, 32)
    assert not torch.allclose(subset[:, 0], full[:, 0])  # fewer tokens attended


def test_forward_tokens_mask_token_and_registers() -> None:
    torch.manual_seed(0)
    vit = ViT(depth=1, embed_dim=32, num_heads=2, num_registers=3, mask_token=True).eval()
    assert vit.num_prefix_tokens == 4
    x = torch.randn(2, 3, 16, 16)
    none = torch.zeros(2, 16, dtype=torch.bool)
    assert torch.equal(vit.forward_tokens(x, mask=none), vit.forward_tokens(x))
    mask = none.clone()
    mask[0, 3] = True
    out = vit.forward_tokens(x, mask=mask)
    assert out.shape == (2, 4 + 16, 32)
    assert torch.equal(out[1], vit.forward_tokens(x)[1])  # other samples unaffected
    # a masked patch's input no longer depends on its pixels
    y = x.clone()
    y[0, :, 0:4, 12:16] = 5.0  # patch index 3 (row 0, column 3)
    assert torch.allclose(vit.forward_tokens(y, mask=mask), out, atol=1e-6)
    with pytest.raises(ValueError, match="mask_token=True"):
        ViT(depth=1, embed_dim=32, num_heads=2).forward_tokens(x, mask=mask)
    assert "register_tokens" not in ViT(depth=1, embed_dim=32, num_heads=2).state_dict()


def test_a_patch_size_mismatch_names_the_transform_the_settings_and_valid_sizes() -> None:
    vit = ViT("tiny", image_size=28, patch_size=14, embed_dim=8, depth=1, num_heads=2)
    images = torch.zeros(1, 3, 32, 32)
    with pytest.raises(ValueError) as training:
        vit.train()(images)
    message = str(training.value)
    assert message.startswith("Image size (32, 32) is not a multiple of the ViT's patch_size 14.")
    assert "train_transform: crop_size of SimCLRViews" in message
    assert "global_size and local_size of MultiCropViews" in message
    assert "(nearest valid sizes: 32 -> 28 or 42)" in message
    assert message.endswith("choose a patch_size that divides them (2, 4, 8, 16, 32).")
    with pytest.raises(ValueError, match=r"eval_transform: crop_size and resize_size of "
                                         r"EvalTransform.*30 -> 28 or 42, 45 -> 42 or 56"):
        vit.eval()(torch.zeros(1, 3, 30, 45))


def test_vit_pool_mean_averages_the_patch_tokens_and_cls_stays_the_default() -> None:
    torch.manual_seed(0)
    vit = mim_vit(num_registers=2)
    x = torch.randn(2, 3, SIZE, SIZE)
    tokens = vit.forward_tokens(x)
    torch.testing.assert_close(vit(x), tokens[:, 0])
    vit.pool = "mean"
    torch.testing.assert_close(vit(x), tokens[:, 3:].mean(dim=1))  # registers excluded
    with pytest.raises(ValueError, match="pool"):
        mim_vit(pool="max")
    with pytest.raises(ValueError, match=r"image_size \(30\) must be a multiple of patch_size"):
        ViT(image_size=30, patch_size=4)
