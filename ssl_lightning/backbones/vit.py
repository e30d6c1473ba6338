"""Vision Transformer backbone returning the [CLS] token, or all tokens for masked methods.

Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale",
ICLR 2021: patch embedding, a learnable [CLS] token, position embeddings and pre-norm transformer
blocks. Sizes follow DeiT (Touvron et al., 2021): tiny 192/12/3, small 384/12/6, base 768/12/12.
Details used by the SSL recipes:

- the position embedding is interpolated (bicubic) to the input's patch grid, so one backbone
  takes both DINO/SwAV global and local crops (Caron et al., "Emerging Properties in
  Self-Supervised Vision Transformers", ICCV 2021);
- ``pos_embed="sincos"`` gives MoCo v3's fixed 2-D sin-cos position embedding (Chen, Xie & He,
  "An Empirical Study of Training Self-Supervised Vision Transformers", ICCV 2021);
- stochastic depth (:class:`DropPath`, Huang et al., 2016) as in DINO's ViT-S recipe;
- :meth:`ViT.forward_tokens` runs on a per-sample subset of patches (MAE, He et al., CVPR 2022;
  I-JEPA, Assran et al., CVPR 2023) or with masked patches replaced by a learned mask token
  (iBOT, Zhou et al., ICLR 2022; SimMIM, Xie et al., CVPR 2022), or with AIM's prefix-causal
  attention (``causal_prefix``, :mod:`ssl_lightning.backbones.prefix_causal`), and returns [CLS],
  register and patch tokens;
- optional register tokens (Darcet et al., "Vision Transformers Need Registers", ICLR 2024);
- DINOv2 / DINOv3 options (Oquab et al., TMLR 2024; Siméoni et al., arXiv 2508.10104):
  ``pos_embed="rope"`` (axial rotary embeddings, :mod:`ssl_lightning.backbones.rope`, no position
  table), LayerScale and SwiGLU (:mod:`ssl_lightning.backbones.vit_layers`), ``norm_eps`` and
  DINOv3's separate final norm of the local crops' [CLS] and registers; every option defaults off,
  so existing checkpoints keep their keys. Released DINOv2 / DINOv3 weights (official and timm
  layouts) load through ``pretrained_path`` (:mod:`ssl_lightning.backbones.released_weights`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones.channels import check_in_chans
from ssl_lightning.backbones.dense import tokens_to_map
from ssl_lightning.backbones.prefix_causal import prefix_causal_mask
from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.rope import RotaryPositionEmbedding, apply_rope
from ssl_lightning.backbones.spec import remember_init_args
from ssl_lightning.backbones.vit_layers import MlpKind, feed_forward, layer_scale
from ssl_lightning.training.sample_rng import row_uniforms

VIT_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
}


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch of a sample with probability ``drop_prob``.

    Inside a keyed forward (:func:`~ssl_lightning.training.sample_rng.keyed_forward`, which
    every ``SSLMethod`` training step runs) each row's keep decision is drawn from its sample's
    key, its crop and the number of this call in the forward
    (:func:`~ssl_lightning.training.sample_rng.row_uniforms`), so it is the same for any number
    of processes and micro-batches; outside one, from torch's global generator. Set
    ``drop_prob = 0`` to disable it (e.g. in a DINO teacher copied from a student).
    """

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        if not 0 <= drop_prob < 1:
            raise ValueError(f"drop_prob must be in [0, 1), got {drop_prob}.")
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        uniforms = row_uniforms(x.shape[0], x.device)
        if uniforms is None:
            mask = x.new_empty(shape).bernoulli_(keep)
        else:
            mask = (uniforms < keep).to(x.dtype).view(shape)
        return x * mask / keep


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(MHSA(LN(x))), then x + ls2(MLP(LN(x))).

    ``layer_scale_init`` adds LayerScale (``ls1``/``ls2``, None: none), ``mlp`` picks the GELU
    MLP or SwiGLU (:mod:`ssl_lightning.backbones.vit_layers`); ``rope`` tables rotate the
    patch queries and keys (:mod:`ssl_lightning.backbones.rope`).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool,
                 drop_path: float, layer_scale_init: float | None = None,
                 mlp: MlpKind = "gelu", norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.ls1 = layer_scale(dim, layer_scale_init)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = feed_forward(dim, mlp_ratio, mlp)
        self.ls2 = layer_scale(dim, layer_scale_init)
        self.drop_path = DropPath(drop_path)

    def attention(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None,
                  attn_mask: Tensor | None = None) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None,
                attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.drop_path(self.ls1(self.attention(self.norm1(x), rope, attn_mask)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


def sincos_position_embedding(grid: int, dim: int, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos embedding (grid², dim): a quarter of the channels per sin/cos of h/w."""
    if dim % 4:
        raise ValueError(f"sin-cos position embedding needs embed_dim divisible by 4, got {dim}.")
    coords = torch.arange(grid, dtype=torch.float64)
    h, w = torch.meshgrid(coords, coords, indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    out_h, out_w = h.reshape(-1, 1) * omega, w.reshape(-1, 1) * omega
    return torch.cat([out_w.sin(), out_w.cos(), out_h.sin(), out_h.cos()], dim=1).float()


class PatchSizeError(ValueError):
    """Images whose sides are not multiples of the ViT's patch size (the CLI shows its one-line
    message whenever it is raised, also from a training step)."""


def patch_size_error(height: int, width: int, patch: int, training: bool) -> PatchSizeError:
    """The error for images whose sides are not multiples of ``patch``: the images' source (the
    training views in train mode, the evaluation transform in eval mode), the settings that
    change their size, the nearest valid sizes and the patch sizes that would fit."""
    nearest = []
    for side in sorted({height, width}):
        below, above = side // patch * patch, -(-side // patch) * patch
        nearest.append(f"{side} -> " + (f"{above}" if below == 0 else f"{below} or {above}"))
    fitting = [p for p in range(2, 33) if height % p == 0 and width % p == 0]
    source = ("the training views (the data module's train_transform: crop_size of SimCLRViews "
              "and the other views, global_size and local_size of MultiCropViews)" if training
              else "the evaluation transform (the data module's eval_transform: crop_size and "
              "resize_size of EvalTransform; crop_size of LinearEvalTransform)")
    return PatchSizeError(
        f"Image size ({height}, {width}) is not a multiple of the ViT's patch_size {patch}. "
        f"The images come from {source}: set those sizes to a multiple of {patch} (nearest "
        f"valid sizes: {', '.join(nearest)}), or choose a patch_size that divides them"
        + (f" ({', '.join(map(str, fitting))})." if fitting else "."))


class ViT(nn.Module):
    """Vision Transformer; ``forward`` returns the final-LayerNorm [CLS] token (B, embed_dim),
    the mean of the patch tokens with ``pool="mean"`` (I-JEPA's evaluation features), or the
    mean of the [CLS] and register tokens with ``pool="prefix"`` (Pixio's evaluation features
    of its 8 class tokens).

    Args:
        arch: ``"tiny"``, ``"small"`` or ``"base"`` (width/depth/heads of DeiT).
        image_size: Training resolution; sets the stored position grid. Other resolutions
            (multi-crop local views) are handled by interpolating the position embedding.
        patch_size: Patch side: 16 for 224 px, 4 for 32 px CIFAR images.
        embed_dim: Override the width of ``arch``.
        depth: Override the number of blocks of ``arch``.
        num_heads: Override the number of heads of ``arch``.
        mlp_ratio: MLP hidden width / embed_dim.
        qkv_bias: Bias on the query/key/value projection.
        drop_path_rate: Stochastic-depth rate of the last block (linearly increasing from 0).
        pos_embed: ``"learned"`` (ViT, DINO), ``"sincos"`` (fixed, MoCo v3) or ``"rope"``
            (DINOv3's rotary embeddings of the patch queries/keys; no position table).
        num_registers: Register tokens after [CLS] (no position embedding); 0: none.
        mask_token: Create a learned mask token for ``forward_tokens(x, mask=...)`` (iBOT,
            SimMIM).
            Both default off, so existing checkpoints keep their keys.
        pool: Features of ``forward``: ``"cls"`` (the [CLS] token), ``"mean"`` (the average of
            the patch tokens) or ``"prefix"`` (the average of [CLS] and the registers); no
            parameters, so checkpoints are the same for all.
        pretrained_path: A local state-dict file to start from (our export, or released
            DINOv2 / DINOv3 weights in the official or timm layout); see
            :mod:`ssl_lightning.backbones.pretrained`.
        rope_base: RoPE period base (DINOv3: 100).
        rope_shift: RoPE training-time coordinate shift range (0: off).
        rope_jitter: RoPE training-time per-axis coordinate scale range, >= 1 (1: off).
        rope_rescale: RoPE training-time coordinate scale range, >= 1 (1: off; DINOv3: 2).
        layer_scale_init: Initial LayerScale value of every residual branch (DINOv2 / DINOv3:
            1e-5); None: no LayerScale.
        mlp: ``"gelu"`` (ViT) or SwiGLU (``"swiglu"``; ``"swiglu32"``/``"64"``/``"128"``
            round the hidden width to that multiple, DINOv3's ViT-7B uses ``"swiglu64"``).
        norm_eps: LayerNorm epsilon (DINOv3's released ViTs: 1e-5).
        untie_global_and_local_cls_norm: DINOv3's ViT-7B recipe: in training, the [CLS] and
            register tokens of ``forward_tokens(x, local_crops=True)`` go through their own final
            norm ``local_cls_norm`` (the patch tokens and evaluation use ``norm``).
        in_chans: Channels of the input images (the patch embedding reads them).
    """

    def __init__(
        self,
        arch: Literal["tiny", "small", "base"] = "tiny",
        image_size: int = 32,
        patch_size: int = 4,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        pos_embed: Literal["learned", "sincos", "rope"] = "learned",
        num_registers: int = 0,
        mask_token: bool = False,
        pool: Literal["cls", "mean", "prefix"] = "cls",
        pretrained_path: str | None = None,
        rope_base: float = 100.0,
        rope_shift: float = 0.0,
        rope_jitter: float = 1.0,
        rope_rescale: float = 1.0,
        layer_scale_init: float | None = None,
        mlp: MlpKind = "gelu",
        norm_eps: float = 1e-6,
        untie_global_and_local_cls_norm: bool = False,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        remember_init_args(self, locals())
        check_in_chans(in_chans)
        if arch not in VIT_SIZES:
            raise ValueError(f"ViT arch must be one of {sorted(VIT_SIZES)}, got {arch!r}.")
        dim, n_blocks, heads = VIT_SIZES[arch]
        dim, n_blocks, heads = embed_dim or dim, depth or n_blocks, num_heads or heads
        if patch_size < 1 or image_size % patch_size:
            raise ValueError(
                f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})."
            )
        if dim % heads:
            raise ValueError(f"embed_dim ({dim}) must be divisible by num_heads ({heads}).")
        if not 0 <= drop_path_rate < 1:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}.")
        if pos_embed not in ("learned", "sincos", "rope"):
            raise ValueError(f"pos_embed must be 'learned', 'sincos' or 'rope', got {pos_embed!r}.")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}.")
        if num_registers < 0:
            raise ValueError(f"num_registers must be >= 0, got {num_registers}.")
        if pool not in ("cls", "mean", "prefix"):
            raise ValueError(f"pool must be 'cls', 'mean' or 'prefix', got {pool!r}.")
        self.pool = pool
        self.patch_size = patch_size
        self.num_registers = num_registers
        #: Tokens before the patch tokens in :meth:`forward_tokens`' output: [CLS] + registers.
        self.num_prefix_tokens = 1 + num_registers
        self.num_features: int = dim
        self.grid = image_size // patch_size
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, num_registers, dim)) if num_registers else None
        )
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim)) if mask_token else None
        self.pos_embed: nn.Parameter | None = None
        self.rope = (RotaryPositionEmbedding(dim // heads, rope_base, rope_shift, rope_jitter,
                                             rope_rescale) if pos_embed == "rope" else None)
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.grid**2 + 1, dim))
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        elif pos_embed == "sincos":
            table = torch.cat([torch.zeros(1, dim), sincos_position_embedding(self.grid, dim)])
            self.pos_embed = nn.Parameter(table.unsqueeze(0), requires_grad=False)
        rates = torch.linspace(0, drop_path_rate, n_blocks).tolist()
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_ratio, qkv_bias, r, layer_scale_init, mlp, norm_eps)
            for r in rates
        )
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.local_cls_norm = (nn.LayerNorm(dim, eps=norm_eps)
                               if untie_global_and_local_cls_norm else None)
        for token in (self.cls_token, self.register_tokens, self.mask_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        self.apply(_init_weights)
        if pretrained_path is not None:
            load_pretrained(self, pretrained_path)

    def position_embedding(self, grid_h: int, grid_w: int) -> Tensor:
        """Position embedding (1, 1 + grid_h·grid_w, D), interpolated when the grid differs."""
        if self.pos_embed is None:
            raise ValueError("A ViT with pos_embed='rope' has no position table.")
        if (grid_h, grid_w) == (self.grid, self.grid):
            return self.pos_embed
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        dim = patch_pos.shape[-1]
        patch_pos = patch_pos.reshape(1, self.grid, self.grid, dim).permute(0, 3, 1, 2)
        patch_pos = F.interpolate(patch_pos, size=(grid_h, grid_w), mode="bicubic",
                                  align_corners=False)
        return torch.cat([cls_pos, patch_pos.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        """The final-LayerNorm [CLS] token, the mean patch token or the mean of the prefix
        tokens (``pool``): (B, embed_dim)."""
        return self.pool_tokens(self.forward_tokens(x))

    def forward_dense(self, x: Tensor, last_blocks: int = 1) -> tuple[Tensor, Tensor]:
        """Patch tokens on their grid (B, D·last_blocks, h, w) and the pooled features (B, D)
        (:mod:`ssl_lightning.backbones.dense`): the final-LayerNorm outputs of the last
        ``last_blocks`` blocks, concatenated along the channels (DINOv2's
        ``get_intermediate_layers``), from one pass."""
        if not 1 <= last_blocks <= len(self.blocks):
            raise ValueError(f"last_blocks must be in [1, {len(self.blocks)}], got {last_blocks}.")
        outputs: list[Tensor] = []
        hooks = [block.register_forward_hook(lambda _m, _i, out: outputs.append(out))
                 for block in self.blocks[len(self.blocks) - last_blocks:-1]]
        try:
            tokens = self.forward_tokens(x)
        finally:
            for hook in hooks:
                hook.remove()
        grid_h, grid_w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        maps = [tokens_to_map(t[:, self.num_prefix_tokens:], grid_h, grid_w)
                for t in [*map(self.norm, outputs), tokens]]
        return torch.cat(maps, dim=1), self.pool_tokens(tokens)

    def forward_features(self, x: Tensor) -> Tensor:
        """Patch tokens on their grid (B, D, h, w)."""
        return self.forward_dense(x)[0]

    def pool_tokens(self, tokens: Tensor) -> Tensor:
        """Features (B, D) of :meth:`forward_tokens`' output, as ``pool`` says."""
        if self.pool == "mean":
            return tokens[:, self.num_prefix_tokens:].mean(dim=1)
        if self.pool == "prefix":
            return tokens[:, :self.num_prefix_tokens].mean(dim=1)
        return tokens[:, 0]

    def forward_tokens(
        self, x: Tensor, keep: Tensor | None = None, mask: Tensor | None = None,
        local_crops: bool = False, causal_prefix: Tensor | None = None,
    ) -> Tensor:
        """All output tokens after the final LayerNorm: (B, prefix + patches, D).

        The first :attr:`num_prefix_tokens` are [CLS] and the registers; then the patch tokens
        in row-major grid order, or in the order of ``keep``.

        Args:
            x: Images (B, 3, H, W), H and W multiples of ``patch_size``.
            keep: (B, K) indices into the row-major patch grid: only these patches (with their
                position embeddings) enter the encoder (MAE's visible set, I-JEPA's context).
            mask: (B, N) bool over the patch grid: True patches are replaced by the learned
                mask token before the position embedding is added (iBOT); needs
                ``mask_token=True``.
            local_crops: ``x`` holds local crops: in training, their [CLS] and registers go
                through ``local_cls_norm`` (``untie_global_and_local_cls_norm``, DINOv3).
            causal_prefix: (B,) int64 prefix lengths in patches, in [0, patches]: prefix-causal
                attention (AIM, :func:`prefix_causal_mask`); None (default): bidirectional.
        """
        if x.shape[-1] % self.patch_size or x.shape[-2] % self.patch_size:
            raise patch_size_error(x.shape[-2], x.shape[-1], self.patch_size, self.training)
        patches = self.patch_embed(x)
        grid_h, grid_w = patches.shape[-2:]
        tokens = patches.flatten(2).transpose(1, 2)
        if mask is not None:
            if self.mask_token is None:
                raise ValueError("forward_tokens(mask=...) needs a ViT built with mask_token=True.")
            if mask.shape != tokens.shape[:2]:
                raise ValueError(
                    f"mask must have shape (B, patches) = {tuple(tokens.shape[:2])}, "
                    f"got {tuple(mask.shape)}."
                )
            tokens = torch.where(mask.unsqueeze(-1), self.mask_token.to(tokens.dtype), tokens)
        if self.rope is None:
            pos = self.position_embedding(grid_h, grid_w)
            tokens = tokens + pos[:, 1:]
        if keep is not None:
            if keep.dim() != 2 or keep.shape[0] != tokens.shape[0]:
                raise ValueError(
                    f"keep must be (B, K) patch indices with B = {tokens.shape[0]}, "
                    f"got shape {tuple(keep.shape)}."
                )
            tokens = tokens.gather(1, keep.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        cls = self.cls_token if self.rope is not None else self.cls_token + pos[:, :1]
        heads = [cls.expand(x.shape[0], -1, -1)]
        if self.register_tokens is not None:
            heads.append(self.register_tokens.expand(x.shape[0], -1, -1))
        tokens = torch.cat([*heads, tokens], dim=1)
        attn_mask = None
        if causal_prefix is not None:
            if keep is not None:
                raise ValueError("forward_tokens: causal_prefix (causal attention over the patch "
                                 "grid) cannot be combined with keep (a subset of the patches).")
            attn_mask = prefix_causal_mask(causal_prefix, self.num_prefix_tokens, grid_h * grid_w)
        rope = None
        for block in self.blocks:  # augmented RoPE: a new draw per block, as DINOv3's code does
            if self.rope is not None and (rope is None or self.rope.augments):
                rope = self.rope(grid_h, grid_w, tokens, keep)
            tokens = block(tokens, rope, attn_mask)
        if local_crops and self.training and self.local_cls_norm is not None:
            head = self.local_cls_norm(tokens[:, :self.num_prefix_tokens])
            return torch.cat([head, self.norm(tokens[:, self.num_prefix_tokens:])], dim=1)
        return self.norm(tokens)


def _init_weights(module: nn.Module) -> None:
    """Truncated-normal (std 0.02) Linear weights, zero biases; patch conv like a Linear."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Conv2d):
        fan_in = module.in_channels * math.prod(module.kernel_size)
        nn.init.trunc_normal_(module.weight, std=math.sqrt(1.0 / fan_in))
        if module.bias is not None:
            nn.init.zeros_(module.bias)
