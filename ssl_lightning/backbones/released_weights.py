"""Released DINOv2 / DINOv3 ViT weights in our :class:`~ssl_lightning.backbones.ViT` keys.

Four layouts are recognised from their keys, besides our own:

- the official DINOv2 code (Oquab et al., TMLR 2024; ``facebookresearch/dinov2``,
  ``DinoVisionTransformer``): ``patch_embed.proj``, ``blocks.i.attn.qkv`` / ``attn.proj``,
  ``mlp.fc1`` / ``fc2`` or the fused SwiGLU ``mlp.w12`` / ``w3``, ``ls1.gamma``,
  ``register_tokens``, a (1, D) ``mask_token``, and ``blocks.c.i.`` for chunked blocks;
- the official DINOv3 code (Siméoni et al., arXiv 2508.10104; ``facebookresearch/dinov3``):
  the same names, ``storage_tokens`` for the registers, ``mlp.w1`` / ``w2`` / ``w3`` for
  SwiGLU, ``rope_embed.periods`` (checked against the ViT's ``rope_base``, then recomputed in
  float32 as timm does) and ``attn.qkv.bias_mask`` (the key bias, masked to 0, is loaded as 0);
- timm's ``vit_*_dinov2*`` (``VisionTransformer``: ``reg_token``, a position table without
  the [CLS] row when the registers carry none, ``mlp.fc1`` packed SwiGLU for ViT-g);
- timm's ``vit_*_dinov3*`` (``Eva``: ``gamma_1`` / ``gamma_2``, ``attn.q_bias`` / ``v_bias``
  with a key bias fixed at 0, ``mlp.fc1_g`` / ``fc1_x`` SwiGLU).

A pre-training-only tensor the ViT was not built for (``mask_token`` without
``mask_token=True``, DINOv3's ``local_cls_norm``) is dropped; a ViT built with a mask token
keeps its own when a timm file has none. Nothing else is guessed: the remaining keys must fit
exactly, and :func:`argument_hint` names the ViT argument a mismatched key belongs to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor, nn

#: Our keys of a ViT block that tell the layout is already ours.
OWN_KEYS = ("patch_embed.weight", "blocks.0.qkv.weight")
_RENAMES = (  # (file pattern, our name), applied in order to every key
    (r"^patch_embed\.proj\.", "patch_embed."),
    (r"^(storage_tokens|reg_token)$", "register_tokens"),
    (r"\.attn\.qkv\.", ".qkv."),
    (r"\.attn\.proj\.", ".proj."),
    (r"\.gamma_([12])$", r".ls\1.gamma"),
    (r"\.mlp\.fc1_g\.", ".mlp.w1."),
    (r"\.mlp\.fc1_x\.", ".mlp.w2."),
)
_DROPPED_IF_UNUSED = ("mask_token", "local_cls_norm.weight", "local_cls_norm.bias")


def detect_layout(state: Mapping[str, Tensor]) -> str:
    """``"ours"``, ``"official DINOv3"``, ``"official DINOv2"``, ``"timm DINOv3 (Eva)"``,
    ``"timm VisionTransformer (DINOv2)"``, or ``"unknown"``, from the keys of ``state``."""
    if any(k in state for k in OWN_KEYS):
        return "ours"
    if "storage_tokens" in state or "rope_embed.periods" in state:
        return "official DINOv3"
    if "patch_embed.proj.weight" not in state:
        return "unknown"
    if any(k.endswith((".gamma_1", ".attn.q_bias")) for k in state) or (
            "pos_embed" not in state and any(".attn.qkv." in k for k in state)):
        return "timm DINOv3 (Eva)"
    if "mask_token" in state or "register_tokens" in state or any(
            re.match(r"blocks\.\d+\.\d+\.", k) for k in state):
        return "official DINOv2"
    return "timm VisionTransformer (DINOv2)"


def to_vit_layout(state: Mapping[str, Tensor], target: nn.Module
                  ) -> tuple[dict[str, Tensor], str, dict[str, str]]:
    """``state`` in ``target``'s (a :class:`~ssl_lightning.backbones.ViT`) keys.

    Returns:
        The converted state, the detected layout (:func:`detect_layout`) and, for every key
        that was renamed, our key -> the file's key (for error messages).

    Raises:
        ValueError: When the file's RoPE periods differ from the ViT's (``rope_base``).
    """
    layout = detect_layout(state)
    if layout in ("ours", "unknown"):
        return dict(state), layout, {}
    expected = target.state_dict()
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}

    def put(key: str, value: Tensor, source: str) -> None:
        out[key] = value
        if key != source:
            origin[key] = source

    for source, value in state.items():
        key = re.sub(r"^blocks\.\d+\.(\d+)\.", r"blocks.\1.", source) \
            if layout == "official DINOv2" else source
        for pattern, name in _RENAMES:
            key = re.sub(pattern, name, key)
        if key == "rope_embed.periods":
            _check_periods(value, target, source)
        elif key.endswith(".qkv.bias_mask"):
            continue  # applied with its bias below
        elif key.endswith(".qkv.bias") and source.replace("bias", "bias_mask") in state:
            mask = state[source.replace("bias", "bias_mask")]
            if not torch.isfinite(mask).all():
                raise ValueError(f"The file's {source.replace('bias', 'bias_mask')!r} is not "
                                 "finite (a model saved before its weights were initialised).")
            put(key, value * mask.to(value.dtype), source)
        elif key.endswith((".attn.q_bias", ".attn.v_bias")):
            if key.endswith(".attn.q_bias"):
                v_bias = state[source.replace("q_bias", "v_bias")]
                put(key.replace(".attn.q_bias", ".qkv.bias"),
                    torch.cat([value, torch.zeros_like(value), v_bias]), source)
        elif key.endswith(".attn.k_bias"):
            continue  # timm's fixed zero buffer
        elif (mlp := re.search(r"\.mlp\.(fc1|fc2|w12)\.", key)) is not None:
            swiglu = f"{key[:mlp.start()]}.mlp.w1.weight" in expected
            if mlp.group(1) == "fc2":
                put(key.replace(mlp.group(0), ".mlp.w3." if swiglu else ".mlp.2."), value, source)
            elif swiglu:  # packed SwiGLU: [gate, value] rows
                gate, linear = value.chunk(2, dim=0)
                put(key.replace(mlp.group(0), ".mlp.w1."), gate, source)
                put(key.replace(mlp.group(0), ".mlp.w2."), linear, source)
            else:
                put(key.replace(mlp.group(0), ".mlp.0." if mlp.group(1) == "fc1" else
                                mlp.group(0)), value, source)
        else:
            put(key, value, source)
    for key in _DROPPED_IF_UNUSED:
        if key in out and key not in expected:
            del out[key]
    if "mask_token" in out and "mask_token" in expected and (
            out["mask_token"].numel() == expected["mask_token"].numel()):
        out["mask_token"] = out["mask_token"].reshape(expected["mask_token"].shape)  # (1, D)
    elif "mask_token" in expected and layout.startswith("timm"):
        out["mask_token"] = expected["mask_token"]  # timm files have none: keep ours
    table, ours = out.get("pos_embed"), expected.get("pos_embed")
    if layout.startswith("timm") and table is not None and ours is not None and (
            table.shape[1] == ours.shape[1] - 1):  # timm's table without the [CLS] row
        out["pos_embed"] = torch.cat([table.new_zeros(1, 1, table.shape[2]), table], dim=1)
    return out, layout, origin


def _check_periods(periods: Tensor, target: nn.Module, key: str) -> None:
    rope = getattr(target, "rope", None)
    if rope is None:
        raise ValueError(f"The file holds RoPE periods ({key!r}): build the ViT with "
                         "pos_embed='rope'.")
    ours = rope.periods()
    if periods.shape != ours.shape or not torch.allclose(periods.double(), ours, rtol=1e-2):
        raise ValueError(
            f"The file's RoPE periods {key!r} {periods.flatten()[:4].tolist()}... differ from the "
            f"ViT's {ours[:4].tolist()}... (rope_base={rope.base}, head width "
            f"{rope.head_dim}); set rope_base (DINOv3: 100), embed_dim and num_heads as the file."
        )


_HINTS = (  # (our key pattern, the ViT argument it needs)
    (r"\.ls[12]\.gamma$", "layer_scale_init (DINOv2/DINOv3: 1e-5)"),
    (r"\.mlp\.w(1|2|3|12)\.", "mlp='swiglu' (and mlp_ratio)"),
    (r"\.mlp\.[02]\.", "mlp='gelu' (and mlp_ratio)"),
    (r"^register_tokens$", "num_registers"),
    (r"^pos_embed$", "pos_embed ('rope' when the file has no position table) and image_size"),
    (r"\.qkv\.bias$", "qkv_bias"),
    (r"^mask_token$", "mask_token"),
    (r"^local_cls_norm\.", "untie_global_and_local_cls_norm"),
)


def argument_hint(key: str) -> str:
    """The ViT argument that decides whether ``key`` exists or its shape, or ``""``."""
    return next((argument for pattern, argument in _HINTS if re.search(pattern, key)), "")
