"""Pixio: Yang et al., "In Pursuit of Pixel Supervision for Visual Pre-training",
arXiv 2512.15715, 2025.

MAE (:class:`~ssl_lightning.methods.MAE`) with three changes (§3, Figure 2):

- a deeper decoder: 32 blocks of width 512 with 16 heads for every encoder size (the official
  ``pretraining/models_pixio.py``), so the encoder need not model pixel detail;
- masking at a larger granularity: the patch grid is cut into ``mask_grid × mask_grid`` cells
  (4 × 4 patches) and a random 75 % of the cells is masked
  (:meth:`~ssl_lightning.masking.RandomUnitMasking.indices`); the encoder sees the patches of
  the kept cells only, as in MAE;
- more class tokens: 8 learned tokens before the patches (here the ViT's [CLS] and 7
  registers, ``ViT(num_registers=7)``); they go through the decoder with the patches, and the
  evaluation features are their mean (``ViT(pool="prefix")``, the official ``eval_knn.py``).

The loss is MAE's (:class:`~ssl_lightning.losses.MAELoss`): the MSE on the per-patch
normalised pixels of the masked patches. AdamW (betas 0.9, 0.95), weight decay 0.05, base lr
2.5e-5 × batch / 256, 40 warm-up epochs, cosine decay to 0 (the official
``pretrain_pixio_vith16_imagenet.sh``). The decoder's positions are MAE's fixed sin-cos table and
its class tokens carry no position (the official decoder learns a table for both).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.masking import RandomUnitMasking
from ssl_lightning.methods.mae import MAE
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName


@register_method(
    "pixio", title="Pixio", configs=("pixio.yaml",),
    paper=Paper("In Pursuit of Pixel Supervision for Visual Pre-training", 2025, "2512.15715"),
    family="masked", views=(8,), tests="tests/methods/test_pixio.py",
    backbone=lambda: small_vit(num_registers=1, pool="prefix"),
    matrix_args={
        "pixio.yaml": ("--model.init_args.decoder_depth", "1",
                       "--model.init_args.decoder_heads", "2"),
    },
    small=lambda backbone, **kw: Pixio(backbone, mask_grid=2, decoder_dim=16, decoder_depth=2,
                                       decoder_heads=2, image_size=8, **kw),
)
class Pixio(MAE):
    """MAE with a deep decoder, masks of ``mask_grid × mask_grid``-patch cells and several class
    tokens (set on the backbone: ``ViT(num_registers=7, pool="prefix")``).

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT`; ``image_size`` must be its image
            size and its patch grid a multiple of ``mask_grid``.
        mask_ratio: Fraction of the cells masked per sample, in (0, 1) (0.75).
        mask_grid: Patches per side of a mask cell (4).
        decoder_dim: Decoder width (512).
        decoder_depth: Decoder blocks (32).
        decoder_heads: Decoder attention heads (16).
        norm_pix_loss: Reconstruct per-patch normalised pixels (the paper's target).
        optimizer: ``"adamw"`` as in the paper.
        lr: Base lr for the ``linear`` scaling rule (2.5e-5).
        weight_decay: 0.05; biases and norms excluded.
        betas: AdamW betas (0.9, 0.95).
        warmup_epochs: 40.
        **kwargs: Other arguments of :class:`~ssl_lightning.methods.SSLMethod`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        mask_ratio: float = 0.75,
        mask_grid: int = 4,
        decoder_dim: int = 512,
        decoder_depth: int = 32,
        decoder_heads: int = 16,
        norm_pix_loss: bool = True,
        optimizer: OptimizerName = "adamw",
        lr: float = 2.5e-5,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_epochs: float = 40.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, mask_ratio=mask_ratio, decoder_dim=decoder_dim,
                         decoder_depth=decoder_depth, decoder_heads=decoder_heads,
                         norm_pix_loss=norm_pix_loss, optimizer=optimizer, lr=lr,
                         weight_decay=weight_decay, betas=betas, warmup_epochs=warmup_epochs,
                         **kwargs)
        if mask_grid < 1 or self.grid % mask_grid:
            raise ValueError(f"Pixio: mask_grid ({mask_grid}) must be >= 1 and divide the patch "
                             f"grid ({self.grid} patches per side); choose a divisor of "
                             f"{self.grid}.")
        self.mask_grid = mask_grid
        self.masking = RandomUnitMasking(self.grid, mask_grid, mask_ratio)
