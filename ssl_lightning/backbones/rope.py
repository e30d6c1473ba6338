"""2-D axial rotary position embeddings (RoPE) of DINOv3.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021) rotate the
queries and keys of attention by angles proportional to the token position, so the score of two
tokens depends on their offset. DINOv3 (Siméoni et al., arXiv 2508.10104, Sec. 3 and App. B)
uses an axial 2-D variant without learned weights:

- patch ``(i, j)`` of an ``H x W`` grid has coordinates ``y = 2 (i + 0.5) / H - 1`` and
  ``x = 2 (j + 0.5) / W - 1`` in [-1, 1] (each axis normalised by its own size), so every crop
  size spans the same range;
- in a head of width ``d``, channel ``c < d/4`` turns with ``y`` and channel ``d/4 + c`` with
  ``x``, both at the period ``p_c = base^(4c / d)``, by the angle ``2π · coordinate / p_c``; the
  rotated pairs are channels ``(k, k + d/2)`` (the "rotate half" layout);
- during training the coordinates are augmented once per call: shifted by ``U(-shift, shift)``
  per axis, then multiplied by a log-uniform factor in ``[1/jitter, jitter]`` per axis, then by
  one log-uniform factor in ``[1/rescale, rescale]`` (DINOv3's recipes use ``rescale = 2``).

The [CLS] token and the registers are not rotated. Tables are computed in float64 on the CPU and
cast to the queries' precision (at least float32). The augmentation is a decision of the whole
step: inside a method's keyed forward it is drawn from the step seed
(:func:`~ssl_lightning.training.sample_rng.step_uniforms`), the same on every rank and
micro-batch; elsewhere from torch's CPU generator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ssl_lightning.training.sample_rng import step_uniforms


def _uniform(count: int, low: float, high: float) -> Tensor:
    """``count`` float64 uniforms in [low, high): the step's (:func:`step_uniforms`) inside a
    keyed forward, else torch's CPU generator's."""
    shared = step_uniforms(count)
    if shared is None:
        return torch.empty(count, dtype=torch.float64).uniform_(low, high)
    return low + (high - low) * shared


class RotaryPositionEmbedding(nn.Module):
    """Sine and cosine tables (N, head_dim) of DINOv3's axial RoPE for a patch grid.

    Args:
        head_dim: Channels per attention head (a multiple of 4).
        base: Period base: ``p_c = base^(4c / head_dim)`` (DINOv3: 100).
        shift: Training-time coordinate shift range (0: off).
        jitter: Training-time per-axis log-uniform scale range, >= 1 (1: off).
        rescale: Training-time log-uniform scale range of both axes together, >= 1 (1: off).
    """

    def __init__(self, head_dim: int, base: float = 100.0, shift: float = 0.0,
                 jitter: float = 1.0, rescale: float = 1.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"RoPE needs a head width (embed_dim / num_heads) divisible by 4, "
                             f"got {head_dim}; change embed_dim or num_heads.")
        if not base > 0:
            raise ValueError(f"rope_base must be > 0, got {base}.")
        if not shift >= 0:
            raise ValueError(f"rope_shift must be >= 0 (0: off), got {shift}.")
        for name, value in (("rope_jitter", jitter), ("rope_rescale", rescale)):
            if not value >= 1:
                raise ValueError(f"{name} must be >= 1 (1: off), got {value}.")
        self.head_dim, self.base = head_dim, base
        self.shift, self.jitter, self.rescale = shift, jitter, rescale

    @property
    def augments(self) -> bool:
        """Whether a call in training mode draws new coordinates."""
        return self.training and (self.shift > 0 or self.jitter > 1 or self.rescale > 1)

    def periods(self) -> Tensor:
        """The periods ``base^(4c / head_dim)``, c < head_dim / 4 (float64)."""
        exponents = torch.arange(self.head_dim // 4, dtype=torch.float64) * 4 / self.head_dim
        return self.base ** exponents

    def coordinates(self, grid_h: int, grid_w: int) -> Tensor:
        """(grid_h · grid_w, 2) patch coordinates (y, x) in row-major order, augmented in
        training mode (float64)."""
        y = (torch.arange(grid_h, dtype=torch.float64) + 0.5) * 2 / grid_h - 1
        x = (torch.arange(grid_w, dtype=torch.float64) + 0.5) * 2 / grid_w - 1
        coords = torch.stack(torch.meshgrid(y, x, indexing="ij"), dim=-1).reshape(-1, 2)
        if not self.training:
            return coords
        if self.shift > 0:
            coords = coords + _uniform(2, -self.shift, self.shift)
        if self.jitter > 1:
            log_j = math.log(self.jitter)
            coords = coords * _uniform(2, -log_j, log_j).exp()
        if self.rescale > 1:
            log_r = math.log(self.rescale)
            coords = coords * _uniform(1, -log_r, log_r).exp()
        return coords

    def forward(self, grid_h: int, grid_w: int, like: Tensor,
                keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(sin, cos)`` for the patches of a ``grid_h x grid_w`` grid, on ``like``'s device in
        its precision (at least float32): (N, head_dim), or (B, 1, K, head_dim) for the
        per-sample patch indices ``keep`` (B, K) (one row per head broadcast)."""
        angles = 2 * math.pi * self.coordinates(grid_h, grid_w)[:, :, None] / self.periods()
        angles = angles.flatten(1).tile(2)  # [y-angles, x-angles] twice: pairs (k, k + d/2)
        dtype = torch.promote_types(like.dtype, torch.float32)
        sin, cos = (t.to(like.device, dtype) for t in (angles.sin(), angles.cos()))
        if keep is not None:
            sin, cos = sin[keep].unsqueeze(1), cos[keep].unsqueeze(1)
        return sin, cos


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (the partner of channel k is k + d/2)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate the last ``N`` tokens of ``x`` (B, heads, prefix + N, head_dim) by ``rope`` =
    ``(sin, cos)`` for N tokens; the first ``prefix`` ([CLS], registers) are left as they are.
    The rotation runs in the tables' precision and returns ``x``'s dtype."""
    sin, cos = rope
    prefix = x.shape[-2] - sin.shape[-2]
    if prefix < 0:
        raise ValueError(f"RoPE tables for {sin.shape[-2]} patches, but only {x.shape[-2]} "
                         "tokens.")
    head, patches = x[..., :prefix, :], x[..., prefix:, :].to(sin.dtype)
    rotated = patches * cos + rotate_half(patches) * sin
    return torch.cat([head, rotated.to(x.dtype)], dim=-2)
