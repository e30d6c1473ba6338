"""Released DINOv2 / DINOv3 weights load into our ViT through ``pretrained_path``: timm's models
(random weights, tiny sizes) give timm's own features, the official layouts (state dicts built
by renaming ours after the official module names, and one with the released ViT-S shapes)
load exactly, and a file that does not fit names its first key and the argument to set."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning import DINO
from ssl_lightning.backbones import ViT
from ssl_lightning.backbones.released_weights import detect_layout

timm = pytest.importorskip("timm")

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0)
OURS = dict(image_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
#: timm name -> (our ViT arguments, layout). fp32 features (|x| <= 2.3) agree to <= 3.6e-7
#: (measured on these cases); the bound is 1e-5.
TIMM_CASES = {
    "vit_small_patch14_dinov2": (dict(layer_scale_init=1e-5), "timm VisionTransformer (DINOv2)"),
    "vit_small_patch14_reg4_dinov2": (dict(layer_scale_init=1e-5, num_registers=4),
                                      "timm VisionTransformer (DINOv2)"),
    # packed SwiGLU fc1; width 48 keeps timm's hidden int(48 · 5.33334) / 2 = 128 a multiple of 8
    "vit_giant_patch14_dinov2": (dict(layer_scale_init=1e-5, mlp="swiglu", embed_dim=48),
                                 "timm VisionTransformer (DINOv2)"),
    "vit_small_patch16_dinov3_qkvb": (dict(pos_embed="rope", num_registers=4, norm_eps=1e-5,
                                           layer_scale_init=1e-5), "timm DINOv3 (Eva)"),
    "vit_small_plus_patch16_dinov3": (dict(pos_embed="rope", num_registers=4, norm_eps=1e-5,
                                           layer_scale_init=1e-5, qkv_bias=False, mlp="swiglu",
                                           mlp_ratio=6.0), "timm DINOv3 (Eva)"),
}


def randomised(state: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor drawn anew (LayerScale's 1e-5 would hide the branches otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in state.items()}


@pytest.mark.parametrize("name", sorted(TIMM_CASES))
def test_timm_dinov2_and_dinov3_models_load_and_give_timms_features(tmp_path, name):
    ours_args, layout = TIMM_CASES[name]
    source = timm.create_model(name, pretrained=False, **{
        **TINY, "embed_dim": ours_args.get("embed_dim", TINY["embed_dim"])}).eval()
    source.load_state_dict(randomised(source.state_dict()))
    path = tmp_path / f"{name}.pth"
    torch.save(source.state_dict(), path)
    assert detect_layout(source.state_dict()) == layout
    vit = ViT(**{**OURS, **ours_args}, pretrained_path=str(path)).eval()
    # the training grid, and a multi-crop size for RoPE (position tables interpolate differently)
    for size in (16, 24) if vit.rope is not None else (16,):
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            expected = source.forward_features(x)
            torch.testing.assert_close(vit.forward_tokens(x), expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(vit(x), expected[:, 0], rtol=0, atol=1e-5)


def official_dinov2(vit: ViT) -> dict[str, torch.Tensor]:
    """``vit``'s weights under the official DINOv2 names (``DinoVisionTransformer`` with
    ``block_chunks=1``: one ``BlockChunk`` holding every block; ``SwiGLUFFNFused``'s ``w12``)."""
    out = {}
    for key, value in vit.state_dict().items():
        name = key.replace("patch_embed.", "patch_embed.proj.").replace("blocks.", "blocks.0.")
        name = name.replace(".qkv.", ".attn.qkv.").replace(".proj.", ".attn.proj.") \
            .replace("patch_embed.attn.proj.", "patch_embed.proj.")
        name = name.replace(".mlp.0.", ".mlp.fc1.").replace(".mlp.2.", ".mlp.fc2.")
        if ".mlp.w2." in name:
            continue
        if ".mlp.w1." in name:
            value = torch.cat([value, vit.state_dict()[key.replace(".w1.", ".w2.")]])
            name = name.replace(".mlp.w1.", ".mlp.w12.")
        out[name] = value.reshape(1, -1) if name == "mask_token" else value
    return out


def official_dinov3(vit: ViT, k_bias: float = 0.5) -> dict[str, torch.Tensor]:
    """``vit``'s weights under the official DINOv3 names (``storage_tokens``, ``rope_embed``,
    ``LinearKMaskedBias``' ``bias_mask`` with a non-zero key bias that the mask removes)."""
    out = {}
    for key, value in vit.state_dict().items():
        name = "storage_tokens" if key == "register_tokens" else key
        name = name.replace("patch_embed.", "patch_embed.proj.")
        name = name.replace(".qkv.", ".attn.qkv.")
        name = name.replace(".proj.", ".attn.proj.").replace("patch_embed.attn.proj.",
                                                             "patch_embed.proj.")
        if name.endswith("attn.qkv.bias"):
            dim = value.shape[0] // 3
            mask = torch.ones_like(value)
            mask[dim:2 * dim] = 0
            value = value.clone()
            value[dim:2 * dim] = k_bias
            out[name + "_mask"] = mask
        out[name] = value.reshape(1, -1) if name == "mask_token" else value
    head = vit.rope.head_dim
    out["rope_embed.periods"] = (100.0 ** (2 * torch.arange(head // 4) / (head // 2))).bfloat16() \
        .float()  # released files hold bf16-rounded periods
    return out


def _randomised_vit(**kwargs) -> ViT:
    vit = ViT(**OURS, **kwargs)
    vit.load_state_dict(randomised(vit.state_dict(), seed=1))
    return vit.eval()


@pytest.mark.parametrize("layout, kwargs", [
    ("official DINOv2", dict(layer_scale_init=1e-5, num_registers=4, mask_token=True)),
    ("official DINOv2", dict(layer_scale_init=1e-5, mlp="swiglu")),
    ("official DINOv3", dict(pos_embed="rope", layer_scale_init=1e-5, num_registers=4,
                             mask_token=True, mlp="swiglu64", norm_eps=1e-5)),
])
def test_official_layouts_load_exactly(tmp_path, layout, kwargs):
    source = _randomised_vit(**kwargs)
    if layout == "official DINOv3":
        state = official_dinov3(source)
        with torch.no_grad():  # the file computes with a zero key bias
            dim = source.num_features
            for block in source.blocks:
                block.qkv.bias[dim:2 * dim] = 0
    else:
        state = official_dinov2(source)
    assert detect_layout(state) == layout
    path = tmp_path / "official.pth"
    torch.save(state, path)
    loaded = ViT(**OURS, **kwargs, pretrained_path=str(path)).eval()
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    if "mask_token" not in kwargs:  # the pre-training mask token is dropped when unused
        torch.save({**state, "mask_token": torch.zeros(1, 32)}, path)
        ViT(**OURS, **kwargs, pretrained_path=str(path))


def test_released_vit_s_shapes_load_as_student_and_teacher(tmp_path):
    """DINOv3 ViT-S/16's and DINOv2 ViT-S/14's keys and shapes, written out from the official
    code (one block)."""
    d, hidden = 384, 1536
    block = {"norm1.weight": (d,), "norm1.bias": (d,), "attn.qkv.weight": (3 * d, d),
             "attn.qkv.bias": (3 * d,), "attn.qkv.bias_mask": (3 * d,),
             "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "ls1.gamma": (d,),
             "norm2.weight": (d,), "norm2.bias": (d,), "mlp.fc1.weight": (hidden, d),
             "mlp.fc1.bias": (hidden,), "mlp.fc2.weight": (d, hidden), "mlp.fc2.bias": (d,),
             "ls2.gamma": (d,)}
    shapes = {"cls_token": (1, 1, d), "storage_tokens": (1, 4, d), "mask_token": (1, d),
              "patch_embed.proj.weight": (d, 3, 16, 16), "patch_embed.proj.bias": (d,),
              "rope_embed.periods": (16,), "norm.weight": (d,), "norm.bias": (d,),
              **{f"blocks.0.{k}": v for k, v in block.items()}}
    state = randomised({k: torch.empty(v) for k, v in shapes.items()})
    state["blocks.0.attn.qkv.bias_mask"] = torch.ones(3 * d)
    state["rope_embed.periods"] = 100.0 ** (torch.arange(16) / 16)
    path = tmp_path / "dinov3_vits16.pth"
    torch.save(state, path)
    vit = ViT("small", image_size=224, patch_size=16, depth=1, pos_embed="rope", num_registers=4,
              layer_scale_init=1e-5, norm_eps=1e-5, pretrained_path=str(path))
    assert torch.equal(vit.register_tokens, state["storage_tokens"])
    method = DINO(vit, head_out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16)
    for name, value in method.teacher_backbone.state_dict().items():
        assert torch.equal(value, method.backbone.state_dict()[name]), name
    assert torch.equal(method.teacher_backbone.blocks[0].ls1.gamma, state["blocks.0.ls1.gamma"])
    # the student augments its RoPE coordinates in training, the teacher (as DINOv3's) does not
    augmented = ViT("small", image_size=224, patch_size=16, depth=1, pos_embed="rope",
                    rope_rescale=2.0)
    method = DINO(augmented, head_out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16).train()
    assert method.backbone.rope.augments and not method.teacher_backbone.rope.augments
    # DINOv2 ViT-S/14: its 37 x 37 position table fits image_size 518, and names image_size else
    dinov2 = {k: v for k, v in state.items() if k not in (
        "storage_tokens", "rope_embed.periods", "blocks.0.attn.qkv.bias_mask")}
    dinov2.update({"pos_embed": torch.randn(1, 1370, d), "patch_embed.proj.weight":
                   torch.randn(d, 3, 14, 14)})
    torch.save(dinov2, path)
    vit = ViT("small", image_size=518, patch_size=14, depth=1, layer_scale_init=1e-5,
              pretrained_path=str(path))
    assert torch.equal(vit.pos_embed, dinov2["pos_embed"])
    with pytest.raises(ValueError, match=r"'pos_embed' has shape \(1, 1370, 384\) in the file and "
                                         r"\(1, 257, 384\) in the model.*image_size"):
        ViT("small", image_size=224, patch_size=14, depth=1, layer_scale_init=1e-5,
            pretrained_path=str(path))


def test_a_file_that_does_not_fit_names_its_first_key_and_the_argument(tmp_path):
    source = timm.create_model("vit_small_patch16_dinov3_qkvb", pretrained=False, **TINY)
    path = tmp_path / "timm.pth"
    torch.save(source.state_dict(), path)
    rope = dict(pos_embed="rope", num_registers=4, norm_eps=1e-5)
    with pytest.raises(ValueError, match=r"\(the file has the timm DINOv3 \(Eva\) layout\): 0 "
                                         r"missing and 4 unexpected keys \(first unexpected key "
                                         r"'blocks.0.ls1.gamma' \(the file's 'blocks.0.gamma_1'\)"
                                         r"\).*layer_scale_init"):
        ViT(**OURS, **rope, pretrained_path=str(path))
    with pytest.raises(ValueError, match=r"first missing key 'pos_embed'.*pos_embed \('rope'"):
        ViT(**OURS, num_registers=4, layer_scale_init=1e-5, pretrained_path=str(path))
    state = official_dinov3(_randomised_vit(pos_embed="rope", layer_scale_init=1e-5))
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"RoPE periods 'rope_embed.periods'.*rope_base=10.0"):
        ViT(**OURS, pos_embed="rope", layer_scale_init=1e-5, rope_base=10.0,
            pretrained_path=str(path))
    with pytest.raises(ValueError, match=r"build the ViT with pos_embed='rope'"):
        ViT(**OURS, layer_scale_init=1e-5, pretrained_path=str(path))
