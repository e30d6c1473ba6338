"""All4One's neighbour transformer: a small encoder over a sequence of neighbour embeddings.

Estepa et al., "All4One: Symbiotic Neighbour Contrastive Learning via Self-Attention and
Redundancy Reduction", ICCV 2023, §3.2: the top-k support-set neighbours of a sample (or the
"shifted" sequence that starts with the sample's own prediction) get fixed sinusoidal position
codes and pass through a transformer encoder (solo-learn: 3 layers, 8 heads, feed-forward 2·D);
the first output token is the sequence's "centroid". The position code is the 1-D sin-cos of
Vaswani et al., "Attention Is All You Need", NeurIPS 2017, §3.5, over the token positions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """(length, dim) codes ``PE[p, 2i] = sin(p / 10000^(2i/dim))``, ``PE[p, 2i+1] = cos(...)``."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : dim // 2]
    return table.float()


class NeighbourTransformer(nn.Module):
    """Sequences (B, L, D) -> the first output token (B, D).

    Args:
        dim: Token width D (the projection size).
        length: Sequence length L (the number of neighbours, k).
        layers: Encoder layers (3).
        heads: Attention heads (8); must divide ``dim``.
        feedforward_multiplier: Feed-forward width as a multiple of ``dim`` (2).
        dropout: Dropout of the encoder layers (solo-learn 0.1; 0 keeps N processes = 1 process,
            because dropout draws come from the per-rank stream, not from the sample).
    """

    positions: Tensor

    def __init__(self, dim: int, length: int, layers: int = 3, heads: int = 8,
                 feedforward_multiplier: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"NeighbourTransformer: heads={heads} must divide the projection "
                             f"size {dim}; change transformer_heads or projection_dim.")
        if length < 1 or layers < 1 or feedforward_multiplier < 1:
            raise ValueError(f"NeighbourTransformer needs length, layers and "
                             f"feedforward_multiplier >= 1, got {length}, {layers}, "
                             f"{feedforward_multiplier}.")
        if not 0 <= dropout < 1:
            raise ValueError(f"NeighbourTransformer dropout must be in [0, 1), got {dropout}.")
        layer = nn.TransformerEncoderLayer(dim, heads, feedforward_multiplier * dim, dropout,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.register_buffer("positions", sinusoidal_positions(length, dim), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 3 or tokens.shape[1:] != self.positions.shape:
            raise ValueError(f"NeighbourTransformer expects (B, {self.positions.shape[0]}, "
                             f"{self.positions.shape[1]}) sequences, got {tuple(tokens.shape)}.")
        return self.encoder(tokens + self.positions.to(tokens.dtype))[:, 0]
