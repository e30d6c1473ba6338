"""What MAE and I-JEPA share beyond the masks: the token-backbone check and the rank layout
the masks are drawn for.

The masks come from torch's global CPU RNG (see :mod:`ssl_lightning.masking`), which
:class:`~ssl_lightning.methods.base.SSLMethod` reseeds before every training batch, the same on
every rank for these methods (``rng_shared_across_ranks``), so a resumed run draws the masks the
uninterrupted run draws.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from torch import Tensor, nn

from ssl_lightning import distributed
from ssl_lightning._lightning import attached_trainer, pl


class TokenBackbone(Protocol):
    """What the masked-image methods use of a ViT (:class:`~ssl_lightning.backbones.ViT`)."""

    patch_size: int
    grid: int
    num_prefix_tokens: int

    def forward_tokens(self, x: Tensor, keep: Tensor | None = None, mask: Tensor | None = None,
                       causal_prefix: Tensor | None = None) -> Tensor: ...

    def pool_tokens(self, tokens: Tensor) -> Tensor: ...

    def __call__(self, x: Tensor) -> Tensor: ...


def as_token_backbone(module: nn.Module) -> TokenBackbone:
    """``module`` typed as a :class:`TokenBackbone` (checked by :func:`token_grid`)."""
    return cast(TokenBackbone, module)


def token_grid(backbone: nn.Module, image_size: int, method: str) -> int:
    """Patches per side of a ViT-like ``backbone`` at ``image_size``, or a ``ValueError``.

    The backbone needs the :class:`TokenBackbone` members (:class:`~ssl_lightning.backbones.ViT`
    has them).
    """
    needed = ("forward_tokens", "pool_tokens", "patch_size", "grid", "num_prefix_tokens")
    if not all(hasattr(backbone, name) for name in needed):
        raise ValueError(
            f"{method} needs a ViT backbone that runs on a subset of patch tokens "
            f"(ssl_lightning.backbones.ViT, with forward_tokens(x, keep=...)); got "
            f"{type(backbone).__name__}."
        )
    vit = as_token_backbone(backbone)
    patch, grid = int(vit.patch_size), int(vit.grid)
    if image_size % patch or image_size // patch != grid:
        raise ValueError(
            f"{method}: image_size {image_size} must be the backbone's image size "
            f"{grid * patch} (a multiple of its patch size {patch}); set model.image_size and "
            "the ViT's image_size to the crop size."
        )
    return grid


def check_views(views: Any, image_size: int, method: str) -> Tensor:
    """The first view, checked to be (B, 3, image_size, image_size)."""
    if len(views) < 1:
        raise ValueError(f"{method} needs one view per sample, got none.")
    x = views[0]
    if x.dim() != 4 or tuple(x.shape[-2:]) != (image_size, image_size):
        raise ValueError(f"{method} expects views of {image_size}x{image_size} px (the "
                         f"backbone's image size), got shape {tuple(x.shape)}.")
    return x


def layout(module: pl.LightningModule) -> tuple[int, int]:
    """``(world_size, rank)`` of the run (Lightning's when attached to a trainer)."""
    if attached_trainer(module) is not None:
        return module.trainer.world_size, module.global_rank
    return distributed.world_size(), distributed.rank()

