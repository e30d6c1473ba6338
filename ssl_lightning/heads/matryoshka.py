"""Franca's Matryoshka heads: nested DINO heads on prefixes of one feature vector.

Venkataramanan et al., "Franca: Nested Matryoshka Clustering for Scalable Visual Representation
Learning", arXiv 2507.14137 (2025), §3.1: the backbone feature z ∈ R^D is read at L nested
prefixes ``z[:D/2^(L-1)], …, z[:D/2], z`` (D/16 … D in the paper, L = 5); each prefix has its own
projection Linear(d, d), DINO head MLP and prototypes, with a prototype count proportional to the
prefix width (``K · d / D``), so the coarse heads cluster into few groups and the full one into K.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from ssl_lightning.heads.prototypes import DINOHead


def matryoshka_widths(dim: int, levels: int) -> list[int]:
    """The nested prefix widths ``[dim / 2^(levels-1), …, dim / 2, dim]``; ``ValueError`` when
    ``dim`` is not divisible by ``2^(levels-1)``."""
    if levels < 1:
        raise ValueError(f"matryoshka_levels must be >= 1, got {levels}.")
    if dim % 2 ** (levels - 1):
        raise ValueError(f"matryoshka_levels={levels} halves the feature width {dim} "
                         f"{levels - 1} times: {dim} must be divisible by {2 ** (levels - 1)}; "
                         "use fewer levels.")
    return [dim // 2 ** (levels - 1 - level) for level in range(levels)]


class MatryoshkaDINOHead(nn.Module):
    """One :class:`DINOHead` per nested prefix of the input, outputs concatenated.

    The output is ``[logits_1 | … | logits_L]`` along the last dimension, level l having
    ``out_sizes[l] = out_dim · d_l / in_dim`` prototypes, so the per-sample reshaping of the DINO
    family works unchanged; :class:`~ssl_lightning.losses.matryoshka.MatryoshkaLoss` splits it.

    Args:
        in_dim: Feature width D.
        out_dim: Prototypes K of the full-width level.
        hidden_dim: Hidden width of every level's MLP.
        bottleneck_dim: Bottleneck of every level.
        levels: L nested prefixes (Franca: 5, widths D/16 … D).
        norm_last_layer: As in :class:`DINOHead`.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, bottleneck_dim: int,
                 levels: int, norm_last_layer: bool = True) -> None:
        super().__init__()
        self.widths = matryoshka_widths(in_dim, levels)
        self.out_sizes = [out_dim * width // in_dim for width in self.widths]
        if self.out_sizes[0] < 1:
            raise ValueError(f"The narrowest Matryoshka level ({self.widths[0]} of {in_dim} "
                             f"features) gets {out_dim} * {self.widths[0]} // {in_dim} = 0 "
                             "prototypes; raise head_out_dim or use fewer levels.")
        projections = [nn.Linear(width, width) for width in self.widths]
        for projection in projections:
            nn.init.trunc_normal_(projection.weight, std=0.02)
            nn.init.zeros_(projection.bias)
        self.projections = nn.ModuleList(projections)
        self.heads = nn.ModuleList(
            DINOHead(width, size, hidden_dim, bottleneck_dim, norm_last_layer=norm_last_layer)
            for width, size in zip(self.widths, self.out_sizes, strict=True))

    def last_layer_parameters(self) -> list[nn.Parameter]:
        """Every level's prototypes (frozen during DINO's first epoch(s))."""
        return [p for head in self.heads for p in cast(DINOHead, head).last_layer_parameters()]

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([head(projection(x[..., :width])) for width, projection, head
                          in zip(self.widths, self.projections, self.heads, strict=True)], dim=-1)
