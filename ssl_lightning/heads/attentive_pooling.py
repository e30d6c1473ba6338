"""The attentive probe's pooling: learned queries cross-attending over frozen tokens.

AIM's head (El-Nouby et al., ICML 2024, §4.1: the attention alone) and, with ``mlp_ratio``,
V-JEPA's cross-attention block (Bardes et al., 2024; the attentive pooler of its released code
with the complete block). Shared by the offline :class:`~ssl_lightning.evaluation.AttentiveEval`
and the online probe's attentive heads (:class:`~ssl_lightning.callbacks.OnlineProbe`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class AttentivePooling(nn.Module):
    """Learned queries cross-attending over tokens: (B, N, D) -> (B, D).

    ``LayerNorm(tokens)`` gives keys and values (``k_proj``, ``v_proj``); the queries
    (``num_queries`` × D, ``q_proj``) attend with ``num_heads`` heads of ``D / num_heads``
    channels, scaled by ``1 / sqrt(D / num_heads)``; the heads' outputs are joined and
    projected (``out_proj``). With ``mlp_ratio`` (V-JEPA's block) the result is
    ``a = queries + out_proj(...)`` then ``a + mlp(mlp_norm(a))``; the query outputs are
    averaged.
    """

    def __init__(self, dim: int, num_heads: int = 1, num_queries: int = 1,
                 mlp_ratio: float | None = None) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"The attentive probe's num_heads ({num_heads}) must divide the "
                             f"token width {dim}.")
        if num_queries < 1:
            raise ValueError(f"num_queries must be >= 1, got {num_queries}.")
        if mlp_ratio is not None and not (mlp_ratio > 0 and int(dim * mlp_ratio) >= 1):
            raise ValueError(f"The attentive probe's mlp_ratio must be > 0 (or null: no MLP "
                             f"block), got {mlp_ratio}.")
        self.num_heads = num_heads
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim)
                                                                for _ in range(4))
        self.mlp_norm: nn.LayerNorm | None = None
        self.mlp: nn.Sequential | None = None
        if mlp_ratio is not None:
            hidden = int(dim * mlp_ratio)
            self.mlp_norm = nn.LayerNorm(dim)
            fc1, fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
            self.mlp = nn.Sequential(fc1, nn.GELU(), fc2)
            for linear in (self.q_proj, self.k_proj, self.v_proj, self.out_proj, fc1, fc2):
                nn.init.normal_(linear.weight, std=0.02)
                nn.init.zeros_(linear.bias)
            with torch.no_grad():  # the residual branches' outputs, as V-JEPA's first block
                self.out_proj.weight.div_(math.sqrt(2.0))
                fc2.weight.div_(math.sqrt(2.0))

    def forward(self, tokens: Tensor) -> Tensor:
        b, n, d = tokens.shape
        h, dh = self.num_heads, d // self.num_heads
        x = self.norm(tokens)
        q = self.q_proj(self.queries).view(-1, h, dh).transpose(0, 1)  # (h, Q, dh)
        k = self.k_proj(x).view(b, n, h, dh).transpose(1, 2)  # (B, h, N, dh)
        v = self.v_proj(x).view(b, n, h, dh).transpose(1, 2)
        attention = (q @ k.transpose(-1, -2) / math.sqrt(dh)).softmax(dim=-1)  # (B, h, Q, N)
        out = self.out_proj((attention @ v).transpose(1, 2).reshape(b, -1, d))  # (B, Q, D)
        if self.mlp is not None and self.mlp_norm is not None:
            out = self.queries + out
            out = out + self.mlp(self.mlp_norm(out))
        return out.mean(dim=1)
