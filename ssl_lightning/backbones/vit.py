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
  (iBOT, Zhou et al., ICLR 2022), and returns [CLS], register and patch tokens;
- optional register tokens (Darcet et al., "Vision Transformers Need Registers", ICLR 2024).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones.dense import tokens_to_map
from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.spec import remember_init_args

VIT_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
}


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch of a sample with probability ``drop_prob``.

    Set ``drop_prob = 0`` to disable it (e.g. in a DINO teacher copied from a student).
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
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep


class Block(nn.Module):
    """Pre-norm transformer block: x + MHSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool,
                 drop_path: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop_path = DropPath(drop_path)

    def attention(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        return self.proj(out.transpose(1, 2).reshape(b, n, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attention(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def sincos_position_embedding(grid: int, dim: int, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos embedding (grid², dim): a quarter of the channels per sin/cos of h/w."""
    if dim % 4:
        raise ValueError(f"sin-cos position embedding needs embed_dim divisible by 4, got {dim}.")
    coords = torch.arange(grid, dtype=torch.float64)
    h, w = torch.meshgrid(coords, coords, indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    out_h, out_w = h.reshape(-1, 1) * omega, w.reshape(-1, 1) * omega
    return torch.cat([out_w.sin(), out_w.cos(), out_h.sin(), out_h.cos()], dim=1).float()


class ViT(nn.Module):
    """Vision Transformer; ``forward`` returns the final-LayerNorm [CLS] token (B, embed_dim),
    or the mean of the patch tokens with ``pool="mean"`` (I-JEPA's evaluation features).

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
        pos_embed: ``"learned"`` (ViT, DINO) or ``"sincos"`` (fixed, MoCo v3).
        num_registers: Register tokens after [CLS] (no position embedding); 0: none.
        mask_token: Create a learned mask token for ``forward_tokens(x, mask=...)`` (iBOT).
            Both default off, so existing checkpoints keep their keys.
        pool: Features of ``forward``: ``"cls"`` (the [CLS] token) or ``"mean"`` (the average of
            the patch tokens); no parameters, so checkpoints are the same for both.
        pretrained_path: A local state-dict file to start from (our export); see
            :mod:`ssl_lightning.backbones.pretrained`.
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
        pos_embed: Literal["learned", "sincos"] = "learned",
        num_registers: int = 0,
        mask_token: bool = False,
        pool: Literal["cls", "mean"] = "cls",
        pretrained_path: str | None = None,
    ) -> None:
        super().__init__()
        remember_init_args(self, locals())
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
        if pos_embed not in ("learned", "sincos"):
            raise ValueError(f"pos_embed must be 'learned' or 'sincos', got {pos_embed!r}.")
        if num_registers < 0:
            raise ValueError(f"num_registers must be >= 0, got {num_registers}.")
        if pool not in ("cls", "mean"):
            raise ValueError(f"pool must be 'cls' or 'mean', got {pool!r}.")
        self.pool = pool
        self.patch_size = patch_size
        self.num_registers = num_registers
        #: Tokens before the patch tokens in :meth:`forward_tokens`' output: [CLS] + registers.
        self.num_prefix_tokens = 1 + num_registers
        self.num_features: int = dim
        self.grid = image_size // patch_size
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, num_registers, dim)) if num_registers else None
        )
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim)) if mask_token else None
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.grid**2 + 1, dim))
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        else:
            table = torch.cat([torch.zeros(1, dim), sincos_position_embedding(self.grid, dim)])
            self.pos_embed = nn.Parameter(table.unsqueeze(0), requires_grad=False)
        rates = torch.linspace(0, drop_path_rate, n_blocks).tolist()
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, qkv_bias, r) for r in rates)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        for token in (self.cls_token, self.register_tokens, self.mask_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        self.apply(_init_weights)
        if pretrained_path is not None:
            load_pretrained(self, pretrained_path)

    def position_embedding(self, grid_h: int, grid_w: int) -> Tensor:
        """Position embedding (1, 1 + grid_h·grid_w, D), interpolated when the grid differs."""
        if (grid_h, grid_w) == (self.grid, self.grid):
            return self.pos_embed
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        dim = patch_pos.shape[-1]
        patch_pos = patch_pos.reshape(1, self.grid, self.grid, dim).permute(0, 3, 1, 2)
        patch_pos = F.interpolate(patch_pos, size=(grid_h, grid_w), mode="bicubic",
                                  align_corners=False)
        return torch.cat([cls_pos, patch_pos.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        """The final-LayerNorm [CLS] token, or the mean patch token (``pool``): (B, embed_dim)."""
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
        return tokens[:, 0]

    def forward_tokens(
        self, x: Tensor, keep: Tensor | None = None, mask: Tensor | None = None
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
        """
        if x.shape[-1] % self.patch_size or x.shape[-2] % self.patch_size:
            raise ValueError(
                f"Image size {tuple(x.shape[-2:])} is not a multiple of patch {self.patch_size}."
            )
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
        pos = self.position_embedding(grid_h, grid_w)
        tokens = tokens + pos[:, 1:]
        if keep is not None:
            if keep.dim() != 2 or keep.shape[0] != tokens.shape[0]:
                raise ValueError(
                    f"keep must be (B, K) patch indices with B = {tokens.shape[0]}, "
                    f"got shape {tuple(keep.shape)}."
                )
            tokens = tokens.gather(1, keep.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        prefix = [(self.cls_token + pos[:, :1]).expand(x.shape[0], -1, -1)]
        if self.register_tokens is not None:
            prefix.append(self.register_tokens.expand(x.shape[0], -1, -1))
        tokens = torch.cat([*prefix, tokens], dim=1)
        for block in self.blocks:
            tokens = block(tokens)
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
