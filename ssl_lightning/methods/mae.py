"""MAE: He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022.

One view per image (random resized crop + flip, :class:`~ssl_lightning.data.MAEViews`). Per
sample, a random 75 % of the patches is masked (argsort of uniform noise, §3); the ViT encoder
runs on the visible patches only, with their own position embeddings; a light decoder
(:class:`~ssl_lightning.heads.MaskedPredictor`: mask tokens, fixed sin-cos positions) predicts
the pixels of the masked patches; :class:`~ssl_lightning.losses.MAELoss` is the MSE on the
per-patch normalised pixels of the masked patches. AdamW (betas 0.9, 0.95), weight decay 0.05,
base lr 1.5e-4 × batch / 256 with warm-up and cosine decay (Appendix A.1, Table 8).

Features for kNN and the online probe are the encoder's features of the *unmasked* image
(``backbone(x)``: the [CLS] token by default, the paper's linear-probing token), computed under
``no_grad``: one extra encoder forward on all patches per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.tokens import (
    as_token_backbone,
    check_views,
    layout,
    token_grid,
)
from ssl_lightning.heads import MaskedPredictor
from ssl_lightning.losses import MAELoss
from ssl_lightning.losses.mae import patchify
from ssl_lightning.masking import RandomMasking, RandomUnitMasking
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.sample_rng import active_keys


@register_method(
    "mae", title="MAE", configs=("mae.yaml",),
    paper=Paper("Masked Autoencoders Are Scalable Vision Learners", 2022, "2111.06377"),
    family="masked", views=(8,), tests="tests/methods/test_mae.py",
    docs="docs/masked_image_modeling.md",
    backbone=lambda: small_vit(),
    cli_args={
        "mae.yaml": ("--model.init_args.backbone.init_args.depth", "1",
                     "--model.init_args.decoder_depth", "1"),
    },
    matrix_args={
        "mae.yaml": ("--model.init_args.decoder_depth", "1",
                     "--model.init_args.decoder_heads", "2"),
    },
    small=lambda backbone, **kw: MAE(backbone, decoder_dim=16, decoder_depth=1, decoder_heads=2,
                                     image_size=8, **kw),
)
class MAE(SSLMethod):
    """Masked autoencoder.

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT` (anything with ``forward_tokens(x,
            keep=...)``); ``image_size`` must be its image size.
        mask_ratio: Fraction of patches masked per sample, in (0, 1) (0.75).
        decoder_dim: Decoder width (512 in the paper).
        decoder_depth: Decoder blocks (8).
        decoder_heads: Decoder attention heads (16).
        norm_pix_loss: Reconstruct per-patch normalised pixels (the paper's default target).
        optimizer: ``"adamw"`` as in the paper.
        lr: Base lr for the ``linear`` scaling rule (1.5e-4).
        weight_decay: 0.05; biases and norms excluded, as in the paper's code.
        betas: AdamW betas (0.9, 0.95).
        warmup_epochs: 40.
        **kwargs: Other arguments of :class:`SSLMethod`.
    """

    #: A mean of per-sample terms: gradient accumulation keeps the objective (no warning).
    batch_coupled_loss = False
    #: Batches without sample seeds: every rank draws the global batch's masks from one CPU
    #: stream and takes its rows.
    rng_shared_across_ranks = True

    def __init__(
        self,
        backbone: nn.Module,
        mask_ratio: float = 0.75,
        decoder_dim: int = 512,
        decoder_depth: int = 8,
        decoder_heads: int = 16,
        norm_pix_loss: bool = True,
        optimizer: OptimizerName = "adamw",
        lr: float = 1.5e-4,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_epochs: float = 40.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                         betas=betas, warmup_epochs=warmup_epochs, **kwargs)
        self.grid = token_grid(backbone, self.image_size, "MAE")
        self.masking: RandomMasking | RandomUnitMasking = RandomMasking(self.grid ** 2,
                                                                        mask_ratio)
        self.patch_size = as_token_backbone(backbone).patch_size
        self.num_prefix_tokens = as_token_backbone(backbone).num_prefix_tokens
        self.decoder = MaskedPredictor(self.feature_dim, self.patch_size ** 2 * 3, self.grid,
                                       decoder_dim, decoder_depth, decoder_heads)
        self.norm_pix_loss = norm_pix_loss

    def build_criterion(self) -> nn.Module:
        return MAELoss(self.norm_pix_loss)

    def draw_masks(self, batch: int) -> tuple[Tensor, Tensor]:
        """``(keep, masked)`` patch indices (B, K), (B, N − K) of this rank's samples: from
        their keys inside a keyed forward, else from the CPU stream shared by the ranks."""
        keys = active_keys()
        if keys is not None:
            return self.masking.indices(batch, seeds=keys.streams(0))
        world, rank = layout(self)
        return self.masking.indices(batch, world, rank)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        x = check_views(views, self.image_size, "MAE")
        keep, masked = (m.to(x.device) for m in self.draw_masks(x.shape[0]))
        tokens = as_token_backbone(self.backbone).forward_tokens(x, keep=keep)
        prefix = self.num_prefix_tokens
        predictions = self.decoder(tokens[:, prefix:], keep, masked, prefix=tokens[:, :prefix])
        pixels = patchify(x, self.patch_size)
        patches = pixels.gather(1, masked.unsqueeze(-1).expand(-1, -1, pixels.shape[-1]))
        with torch.no_grad():
            features = self.backbone(x)
        return {"predictions": predictions, "patches": patches, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["predictions"], outputs["patches"])
