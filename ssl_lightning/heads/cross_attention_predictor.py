"""CAPI's predictor: mask tokens that cross-attend to the encoder's visible tokens.

Darcet et al., "Cluster and Predict Latent Patches for Improved Masked Image Modeling",
arXiv 2502.08769, 2025, §3.3: one learned mask token per position to predict; every block is a
pre-norm cross-attention from these queries to the encoder's output tokens (visible patches and
registers) followed by a pre-norm MLP. The queries never attend to each other, so each
prediction depends on its own position and the visible tokens only. Positions: the queries get
a fixed 2-D sin-cos embedding of their grid position (the encoder's tokens carry the encoder's
own); the official code rotates queries and keys with RoPE instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones.vit import _init_weights, sincos_position_embedding


class CrossAttentionBlock(nn.Module):
    """``x + attn(LN(x), LN(context))``, then ``x + mlp(LN(x))``.

    Args:
        dim: Width of the queries.
        context_dim: Width of the context tokens.
        num_heads: Attention heads (``dim`` must be divisible by them).
        mlp_ratio: MLP hidden width / dim.
    """

    def __init__(self, dim: int, context_dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm_query, self.norm_context = nn.LayerNorm(dim), nn.LayerNorm(context_dim)
        self.query = nn.Linear(dim, dim)
        self.key_value = nn.Linear(context_dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm_mlp = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        b, q_len, d = x.shape
        heads = self.num_heads
        q = self.query(self.norm_query(x)).view(b, q_len, heads, d // heads).transpose(1, 2)
        k, v = self.key_value(self.norm_context(context)).view(
            b, context.shape[1], 2, heads, d // heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, q_len, d)
        x = x + self.proj(out)
        return x + self.mlp(self.norm_mlp(x))


class CrossAttentionPredictor(nn.Module):
    """Predictions (B, Q, embed_dim) at query grid positions from encoder tokens.

    Args:
        in_dim: Width of the encoder tokens.
        grid: Patches per side of the grid the query positions index (row-major).
        embed_dim: Width of the predictor (CAPI: the encoder's).
        depth: Blocks (CAPI ViT-L: 12).
        num_heads: Attention heads.
        mlp_ratio: MLP hidden width / embed_dim.
    """

    pos_embed: Tensor

    def __init__(self, in_dim: int, grid: int, embed_dim: int, depth: int, num_heads: int,
                 mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if min(in_dim, grid, embed_dim, depth, num_heads) < 1 or embed_dim % num_heads:
            raise ValueError("CrossAttentionPredictor needs sizes >= 1 and embed_dim divisible "
                             f"by num_heads, got in_dim={in_dim}, grid={grid}, embed_dim="
                             f"{embed_dim}, depth={depth}, num_heads={num_heads}.")
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer("pos_embed", sincos_position_embedding(grid, embed_dim),
                             persistent=False)
        self.blocks = nn.ModuleList(CrossAttentionBlock(embed_dim, in_dim, num_heads, mlp_ratio)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.apply(_init_weights)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def forward(self, context: Tensor, queries: Tensor) -> Tensor:
        """``context`` (B, C, in_dim): the encoder's tokens; ``queries`` (B, Q): grid indices."""
        x = self.mask_token.to(context.dtype) + self.pos_embed.to(context.dtype)[queries]
        for block in self.blocks:
            x = block(x, context)
        return self.norm(x)
