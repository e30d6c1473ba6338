"""Optional layers of the ViT block used by DINOv2 and DINOv3: LayerScale and a SwiGLU MLP.

- LayerScale (Touvron et al., "Going deeper with Image Transformers", CaiT, ICCV 2021):
  each residual branch is multiplied channel-wise by a learned ``gamma`` initialised to a small
  constant (DINOv2 and DINOv3: 1e-5).
- SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020): ``W3 (SiLU(W1 x) ⊙ W2 x)``.
  Its hidden width follows DINOv2 / DINOv3 (``SwiGLUFFN``): two thirds of the GELU MLP's
  ``int(dim · mlp_ratio)``, rounded up to a multiple of ``align`` (8; the ViT-7B recipe's
  ``swiglu64``: 64), so the parameter count stays close to the GELU MLP's.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: ``mlp`` values of :class:`~ssl_lightning.backbones.ViT` and the SwiGLU width alignment.
MLP_KINDS: dict[str, int] = {"gelu": 0, "swiglu": 8, "swiglu32": 32, "swiglu64": 64,
                             "swiglu128": 128}
MlpKind = Literal["gelu", "swiglu", "swiglu32", "swiglu64", "swiglu128"]


class LayerScale(nn.Module):
    """``x · gamma`` with a learned per-channel ``gamma`` initialised to ``init``."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


def swiglu_hidden_dim(dim: int, mlp_ratio: float, align: int) -> int:
    """DINOv2/DINOv3's SwiGLU width: ``int(int(dim · mlp_ratio) · 2/3)`` rounded up to
    ``align``."""
    width = int(int(dim * mlp_ratio) * 2 / 3)
    return width + (-width % align)


class SwiGLU(nn.Module):
    """SwiGLU feed-forward ``w3(SiLU(w1 x) · w2 x)`` (the official DINOv3 module names)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(dim, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def feed_forward(dim: int, mlp_ratio: float, kind: str) -> nn.Module:
    """The block's MLP: GELU (``Linear, GELU, Linear``: keys ``0`` and ``2``) or SwiGLU."""
    if kind not in MLP_KINDS:
        raise ValueError(f"mlp must be one of {sorted(MLP_KINDS)}, got {kind!r}.")
    if kind == "gelu":
        hidden = int(dim * mlp_ratio)
        return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
    return SwiGLU(dim, swiglu_hidden_dim(dim, mlp_ratio, MLP_KINDS[kind]))


def layer_scale(dim: int, init: float | None) -> nn.Module:
    """A :class:`LayerScale` for ``init``, or the identity (no parameters) for ``None``."""
    if init is None:
        return nn.Identity()
    if not init > 0:
        raise ValueError(f"layer_scale_init must be > 0 (None: no LayerScale), got {init}.")
    return LayerScale(dim, init)
