"""The DINOv2 / DINOv3 ViT options against references written from their equations in float64:
axial RoPE (DINOv3, arXiv 2508.10104), LayerScale (CaiT), SwiGLU, the local-crop [CLS] norm."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.backbones import ViT
from ssl_lightning.backbones.rope import RotaryPositionEmbedding
from ssl_lightning.backbones.vit import Block
from ssl_lightning.backbones.vit_layers import swiglu_hidden_dim

DIM, HEADS = 16, 2  # head width 8: periods base^(0/8), base^(4/8)


def rope_vit(**kwargs) -> ViT:
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=4, embed_dim=DIM, depth=1, num_heads=HEADS,
                pos_embed="rope")
    args.update(kwargs)
    return ViT(**args).double().eval()


def rotate_by_hand(vec: torch.Tensor, y: float, x: float, base: float) -> torch.Tensor:
    """RoPE of one head vector: channel c < d/4 turns with y, d/4 <= c < d/2 with x, each with
    its partner c + d/2, by 2π · coordinate / base^(4 (c mod d/4) / d)."""
    d = vec.shape[0]
    out = vec.clone()
    for c in range(d // 2):
        coordinate = y if c < d // 4 else x
        theta = 2 * math.pi * coordinate / base ** (4 * (c % (d // 4)) / d)
        a, b = vec[c].item(), vec[c + d // 2].item()
        out[c] = a * math.cos(theta) - b * math.sin(theta)
        out[c + d // 2] = a * math.sin(theta) + b * math.cos(theta)
    return out


def attention_by_hand(block: Block, x: torch.Tensor, positions: list[tuple[float, float] | None],
                      base: float) -> torch.Tensor:
    """Multi-head attention of one sample (N, D) with the tokens' RoPE coordinates (None: the
    [CLS] and registers, not rotated)."""
    n, dim = x.shape
    d = dim // block.num_heads
    qkv = x @ block.qkv.weight.T + block.qkv.bias
    heads = []
    for h in range(block.num_heads):
        q, k, v = (qkv[:, part * dim + h * d: part * dim + (h + 1) * d] for part in range(3))
        q, k = ([t[i] if positions[i] is None else rotate_by_hand(t[i], *positions[i], base)
                 for i in range(n)] for t in (q, k))
        scores = torch.stack(q) @ torch.stack(k).T / math.sqrt(d)
        heads.append(scores.softmax(-1) @ v)
    return torch.cat(heads, dim=-1) @ block.proj.weight.T + block.proj.bias


def coordinates_by_hand(grid_h: int, grid_w: int) -> list[tuple[float, float]]:
    """DINOv3's patch coordinates in [-1, 1], row-major: (2 (i + ½) / H − 1, 2 (j + ½) / W − 1)."""
    return [(2 * (i + 0.5) / grid_h - 1, 2 * (j + 0.5) / grid_w - 1)
            for i in range(grid_h) for j in range(grid_w)]


def test_rope_vit_matches_a_hand_written_forward_with_registers_and_a_non_square_grid():
    base = 10.0
    vit = rope_vit(num_registers=2, rope_base=base)
    assert vit.pos_embed is None and "pos_embed" not in vit.state_dict()
    x = torch.randn(2, 3, 8, 12, dtype=torch.float64)  # a 2 x 3 grid: transposing h, w shows
    block = vit.blocks[0]
    positions = [None] * 3 + coordinates_by_hand(2, 3)
    for b in range(2):
        tokens = torch.cat([vit.cls_token[0], vit.register_tokens[0],
                            vit.patch_embed(x[b:b + 1]).flatten(2)[0].T])
        tokens = tokens + attention_by_hand(block, block.norm1(tokens), positions, base)
        tokens = vit.norm(tokens + block.mlp(block.norm2(tokens)))
        torch.testing.assert_close(vit.forward_tokens(x)[b], tokens, rtol=0, atol=1e-12)


def test_rope_follows_the_kept_patches_and_multi_crop_sizes():
    vit = rope_vit()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    full = vit.forward_tokens(x)
    perm = torch.stack([torch.randperm(16), torch.randperm(16)])
    # attention is equivariant to the token order when each patch keeps its own rotation
    permuted = vit.forward_tokens(x, keep=perm)
    torch.testing.assert_close(permuted[:, 1:], full[:, 1:].gather(
        1, perm.unsqueeze(-1).expand(-1, -1, DIM)), rtol=0, atol=1e-12)
    # a subset: the kept patches attend to each other at their grid positions
    keep = perm[:, :5]
    block, base = vit.blocks[0], 100.0
    grid = coordinates_by_hand(4, 4)
    for b in range(2):
        tokens = torch.cat([vit.cls_token[0], vit.patch_embed(x[b:b + 1]).flatten(2)[0].T[keep[b]]])
        positions = [None] + [grid[i] for i in keep[b].tolist()]
        tokens = tokens + attention_by_hand(block, block.norm1(tokens), positions, base)
        tokens = vit.norm(tokens + block.mlp(block.norm2(tokens)))
        torch.testing.assert_close(vit.forward_tokens(x, keep=keep)[b], tokens, rtol=0, atol=1e-12)
    # a local crop spans the same [-1, 1] range on its smaller grid
    coords = vit.rope.coordinates(2, 2)
    torch.testing.assert_close(coords, torch.tensor(coordinates_by_hand(2, 2), dtype=torch.float64))
    assert vit.forward_tokens(torch.randn(2, 3, 8, 8, dtype=torch.float64)).shape == (2, 5, DIM)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 3] = True
    masked = rope_vit(mask_token=True).forward_tokens(x, mask=mask)
    assert masked.shape == (2, 17, DIM) and torch.isfinite(masked).all()


def test_rope_training_augmentation_draws_shift_then_jitter_then_rescale():
    rope = RotaryPositionEmbedding(8, shift=0.5, jitter=1.5, rescale=2.0).train()
    torch.manual_seed(3)
    got = rope.coordinates(2, 3)
    torch.manual_seed(3)
    shift = torch.empty(2, dtype=torch.float64).uniform_(-0.5, 0.5)
    jitter = torch.empty(2, dtype=torch.float64).uniform_(-math.log(1.5), math.log(1.5)).exp()
    rescale = torch.empty(1, dtype=torch.float64).uniform_(-math.log(2), math.log(2)).exp()
    expected = [((y + shift[0].item()) * jitter[0].item() * rescale.item(),
                 (x + shift[1].item()) * jitter[1].item() * rescale.item())
                for y, x in coordinates_by_hand(2, 3)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0,
                               atol=1e-15)
    assert torch.equal(rope.eval().coordinates(2, 3),
                       torch.tensor(coordinates_by_hand(2, 3), dtype=torch.float64))
    # off by default: training draws nothing and equals evaluation
    vit = rope_vit(depth=2)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    state = torch.random.get_rng_state()
    torch.testing.assert_close(vit.train().forward_tokens(x), vit.eval().forward_tokens(x))
    assert torch.equal(torch.random.get_rng_state(), state)
    # on: a new draw per block (DINOv3's code), reproducible from the seed
    augmented = rope_vit(depth=2, rope_rescale=2.0).train()
    torch.manual_seed(5)
    first = augmented.forward_tokens(x)
    torch.manual_seed(5)
    torch.testing.assert_close(augmented.forward_tokens(x), first, rtol=0, atol=0)
    assert not torch.allclose(first, augmented.eval().forward_tokens(x))


def test_layer_scale_scales_each_residual_branch():
    torch.manual_seed(0)
    block = Block(DIM, HEADS, 4.0, True, 0.0, layer_scale_init=1e-5).double()
    assert torch.equal(block.ls1.gamma.float(), torch.full((DIM,), 1e-5))
    with torch.no_grad():
        block.ls1.gamma.normal_()
        block.ls2.gamma.normal_()
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    after_attention = x + block.ls1.gamma * block.attention(block.norm1(x))
    expected = after_attention + block.ls2.gamma * block.mlp(block.norm2(after_attention))
    torch.testing.assert_close(block(x), expected, rtol=0, atol=1e-12)


def test_default_options_keep_the_state_dict_keys_of_existing_checkpoints():
    keys = set(ViT(depth=1, embed_dim=DIM, num_heads=HEADS).state_dict())
    assert keys == {"cls_token", "pos_embed", "patch_embed.weight", "patch_embed.bias",
                    "norm.weight", "norm.bias"} | {
        f"blocks.0.{name}" for name in (
            "norm1.weight", "norm1.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
            "norm2.weight", "norm2.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
            "mlp.2.bias")}


def test_swiglu_matches_its_formula_and_the_official_hidden_widths():
    # int(int(dim * ratio) * 2/3) rounded up to the alignment (DINOv2/DINOv3 SwiGLUFFN)
    assert swiglu_hidden_dim(384, 4.0, 8) == 1024  # ViT-S
    assert swiglu_hidden_dim(384, 6.0, 8) == 1536  # ViT-S+ (ffn_ratio 6)
    assert swiglu_hidden_dim(4096, 3.0, 64) == 8192  # ViT-7B (swiglu64, ffn_ratio 3)
    assert swiglu_hidden_dim(32, 4.0, 8) == 88  # int(128 · 2/3) = 85 -> 88
    torch.manual_seed(0)
    block = Block(DIM, HEADS, 4.0, True, 0.0, mlp="swiglu").double()
    mlp = block.mlp
    assert mlp.w1.out_features == swiglu_hidden_dim(DIM, 4.0, 8) == 48
    z = torch.randn(3, DIM, dtype=torch.float64)
    gate = z @ mlp.w1.weight.T + mlp.w1.bias
    value = z @ mlp.w2.weight.T + mlp.w2.bias
    silu = gate / (1 + torch.exp(-gate))
    expected = (silu * value) @ mlp.w3.weight.T + mlp.w3.bias
    torch.testing.assert_close(mlp(z), expected, rtol=0, atol=1e-12)
    assert ViT(depth=1, embed_dim=DIM, num_heads=HEADS, mlp="swiglu64").blocks[0].mlp \
        .w1.out_features == 64


def test_untied_local_cls_norm_applies_to_local_crops_in_training_only():
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=DIM, depth=1, num_heads=HEADS,
              num_registers=2, untie_global_and_local_cls_norm=True).double()
    with torch.no_grad():
        vit.local_cls_norm.weight.normal_()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    shared = vit.train().forward_tokens(x)
    local = vit.forward_tokens(x, local_crops=True)
    pre_norm = vit.patch_embed(x).flatten(2).transpose(1, 2) + vit.position_embedding(2, 2)[:, 1:]
    pre_norm = torch.cat([(vit.cls_token + vit.pos_embed[:, :1]).expand(2, -1, -1),
                          vit.register_tokens.expand(2, -1, -1), pre_norm], dim=1)
    pre_norm = vit.blocks[0](pre_norm)
    torch.testing.assert_close(local[:, :3], vit.local_cls_norm(pre_norm[:, :3]), rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(local[:, 3:], shared[:, 3:], rtol=0, atol=0)
    assert not torch.allclose(local[:, :3], shared[:, :3])
    torch.testing.assert_close(vit.eval().forward_tokens(x, local_crops=True), shared,
                               rtol=0, atol=0)
    assert "local_cls_norm.weight" not in ViT(depth=1, embed_dim=DIM, num_heads=HEADS).state_dict()


@pytest.mark.parametrize("kwargs", [dict(layer_scale_init=1e-5, mlp="swiglu"),
                                    dict(pos_embed="rope", rope_rescale=2.0)])
def test_options_give_every_parameter_a_gradient(kwargs):
    vit = ViT(image_size=16, patch_size=4, embed_dim=DIM, depth=1, num_heads=HEADS, **kwargs)
    vit(torch.randn(2, 3, 16, 16)).sum().backward()
    assert all(p.grad is not None for p in vit.parameters() if p.requires_grad)


def test_rope_augmentation_is_a_decision_of_the_step_on_every_rank_and_micro_batch():
    """Inside a keyed forward the coordinate augmentation comes from the step seed: the halves
    of a batch on two ranks, and micro-batches, draw what the whole batch draws; the rank's own
    CPU generator plays no part."""
    from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward

    vit = rope_vit(depth=2, rope_shift=0.3, rope_jitter=1.2, rope_rescale=2.0).train()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    seeds = torch.arange(10, 14)

    def run(rows: slice, rank: int, world: int, step_seed: int = 7) -> torch.Tensor:
        keys = SampleKeys.from_seeds(seeds[rows], rng_seed=1, rank=rank, world_size=world,
                                     step_seed=step_seed)
        torch.manual_seed(100 + rank)  # per-rank CPU streams, as under DDP
        with keyed_forward(keys):
            return vit.forward_tokens(x[rows])

    whole = run(slice(0, 4), 0, 1)
    halves = torch.cat([run(slice(0, 2), 0, 2), run(slice(2, 4), 1, 2)])
    torch.testing.assert_close(halves, whole, rtol=0, atol=1e-12)
    assert not torch.allclose(run(slice(0, 4), 0, 1, step_seed=8), whole)
