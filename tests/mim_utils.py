"""Tiny MAE / I-JEPA / SimMIM / AIM models for the masked-image tests (16 px images, 2 px
patches: 8x8 grid)."""

from __future__ import annotations

from typing import Any

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import AIM, IJEPA, MAE, SimMIM

SIZE, PATCH, GRID = 16, 2, 8


def tiny_vit(**kwargs: Any) -> ViT:
    """A 1-block ViT of width 32 on 16 px images with 2 px patches."""
    args: dict[str, Any] = dict(image_size=SIZE, patch_size=PATCH, embed_dim=32, depth=1,
                                num_heads=2, pos_embed="sincos")
    return ViT(**{**args, **kwargs})


def tiny_mae(**kwargs: Any) -> MAE:
    args: dict[str, Any] = dict(decoder_dim=16, decoder_depth=1, decoder_heads=2,
                                image_size=SIZE, lr=1e-3, lr_scaling="none", warmup_epochs=0)
    return MAE(tiny_vit(), **{**args, **kwargs})


def tiny_ijepa(**kwargs: Any) -> IJEPA:
    args: dict[str, Any] = dict(predictor_dim=16, predictor_depth=1, predictor_heads=2,
                                image_size=SIZE, lr=1e-3, lr_scaling="none", warmup_epochs=0,
                                momentum_base=0.9)
    return IJEPA(tiny_vit(pool="mean"), **{**args, **kwargs})


def tiny_simmim(**kwargs: Any) -> SimMIM:
    """SimMIM on the tiny ViT with a mask token, mask units of 2 x 2 patches."""
    args: dict[str, Any] = dict(mask_patch_size=2 * PATCH, image_size=SIZE, lr=1e-3,
                                lr_scaling="none", warmup_epochs=0)
    return SimMIM(tiny_vit(mask_token=True), **{**args, **kwargs})


def tiny_aim(**kwargs: Any) -> AIM:
    args: dict[str, Any] = dict(head_hidden_dim=16, head_layers=2, image_size=SIZE, lr=1e-3,
                                lr_scaling="none", warmup_epochs=0)
    return AIM(tiny_vit(pool="mean"), **{**args, **kwargs})
