"""A narrow transformer that predicts masked positions from encoder tokens: the MAE decoder and
the I-JEPA predictor.

MAE (He et al., CVPR 2022, §3): the encoder's visible tokens are projected to the decoder width,
mask tokens are added for the masked positions, a fixed 2-D sin-cos position embedding is added
to all, and a few transformer blocks + LayerNorm + a linear layer predict each masked patch's
pixels. I-JEPA (Assran et al., CVPR 2023, §3): the same structure on the context tokens, one
sequence per target block, predicting the target encoder's patch representations.

Attention is permutation-equivariant, so the sequence order does not matter (MAE's code restores
raster order first; the result per token is the same).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.vit import Block, _init_weights, sincos_position_embedding


class MaskedPredictor(nn.Module):
    """Predict outputs at query positions from tokens at known positions of a patch grid.

    Args:
        in_dim: Width of the encoder tokens.
        out_dim: Output size per query (MAE: patch² · 3 pixels; I-JEPA: the encoder width).
        grid: Patches per side of the grid the positions index (row-major).
        embed_dim: Width of the predictor (MAE decoder 512, I-JEPA predictor 384).
        depth: Transformer blocks (MAE 8, I-JEPA 6-12).
        num_heads: Attention heads (MAE 16, I-JEPA 12 / 16).
        mlp_ratio: MLP hidden width / embed_dim.
    """

    pos_embed: Tensor

    def __init__(self, in_dim: int, out_dim: int, grid: int, embed_dim: int = 512,
                 depth: int = 8, num_heads: int = 16, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if min(in_dim, out_dim, grid, embed_dim, depth, num_heads) < 1:
            raise ValueError("MaskedPredictor sizes must be >= 1, got "
                             f"in_dim={in_dim}, out_dim={out_dim}, grid={grid}, "
                             f"embed_dim={embed_dim}, depth={depth}, num_heads={num_heads}.")
        if embed_dim % num_heads:
            raise ValueError(f"Predictor embed_dim ({embed_dim}) must be divisible by num_heads "
                             f"({num_heads}).")
        self.embed = nn.Linear(in_dim, embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer("pos_embed", sincos_position_embedding(grid, embed_dim),
                             persistent=False)
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, drop_path=0.0)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.proj = nn.Linear(embed_dim, out_dim)
        self.apply(_init_weights)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def forward(self, tokens: Tensor, positions: Tensor, queries: Tensor,
                prefix: Tensor | None = None) -> Tensor:
        """Predictions (B, Q, out_dim) at the ``queries`` positions.

        Args:
            tokens: Encoder tokens (B, K, in_dim) at grid ``positions`` (B, K).
            positions: Grid indices of ``tokens``.
            queries: Grid indices (B, Q) to predict; they get the mask token.
            prefix: Optional tokens without a position ((B, P, in_dim), MAE's [CLS]).
        """
        pos = self.pos_embed.to(tokens.dtype)
        x = self.embed(tokens) + pos[positions]
        q = self.mask_token.to(x.dtype) + pos[queries]
        parts = [x, q] if prefix is None else [self.embed(prefix), x, q]
        x = torch.cat(parts, dim=1)
        for block in self.blocks:
            x = block(x)
        return self.proj(self.norm(x[:, -queries.shape[1]:]))
