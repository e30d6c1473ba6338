"""SimMIM: Xie et al., "SimMIM: A Simple Framework for Masked Image Modeling", CVPR 2022.

One view per image (random resized crop + flip). Per sample, a random 60 % of square mask units
(32 px on 16 px ViT patches: 2 × 2 patches) is masked (:class:`~ssl_lightning.masking.
RandomUnitMasking`, §3.1). The ViT encoder sees every position: the masked patch embeddings are
replaced by a learned mask token (``ViT(mask_token=True)``, ``forward_tokens(x, mask=...)``)
before the position embedding is added, as in the paper's code; a linear decoder (one linear
layer per patch token, the paper's 1×1 convolution + pixel shuffle) predicts each patch's raw
pixels, and :class:`~ssl_lightning.losses.SimMIMLoss` is the ℓ1 error on the masked patches
only. AdamW (betas 0.9, 0.999), weight decay 0.05, base lr 1e-4 × batch / 512, warm-up then
decay (the code's ViT-B config).

Features for kNN and the online probe are the encoder's features of the *unmasked* image
(``backbone(x)``), computed under ``no_grad``: one extra encoder forward per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.tokens import as_token_backbone, check_views, layout, token_grid
from ssl_lightning.losses import SimMIMLoss
from ssl_lightning.losses.mae import patchify
from ssl_lightning.masking import RandomUnitMasking
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.sample_rng import active_keys


@register_method(
    "simmim", title="SimMIM", configs=("simmim.yaml",),
    paper=Paper("SimMIM: A Simple Framework for Masked Image Modeling", 2022, "2111.09886"),
    family="masked", views=(8,), tests="tests/methods/test_simmim.py",
    backbone=lambda: small_vit(mask_token=True),
    small=lambda backbone, **kw: SimMIM(backbone, mask_patch_size=4, image_size=8, **kw),
)
class SimMIM(SSLMethod):
    """Masked image modelling with mask tokens, a linear decoder and an ℓ1 pixel loss.

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT` built with ``mask_token=True``;
            ``image_size`` must be its image size.
        mask_ratio: Fraction of the mask units masked per sample, in (0, 1) (0.6).
        mask_patch_size: Side of a mask unit in pixels, a multiple of the ViT's patch size that
            divides ``image_size`` (32 for 16 px patches; None: the patch size).
        optimizer: ``"adamw"`` as in the paper.
        lr: Base lr for the ``linear`` scaling rule, per 256 images (the code's 1e-4 per 512).
        weight_decay: 0.05; biases and norms excluded.
        betas: AdamW betas (0.9, 0.999).
        warmup_epochs: 10.
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
        mask_ratio: float = 0.6,
        mask_patch_size: int | None = None,
        optimizer: OptimizerName = "adamw",
        lr: float = 5e-5,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                         betas=betas, warmup_epochs=warmup_epochs, **kwargs)
        grid = token_grid(backbone, self.image_size, "SimMIM")
        vit = as_token_backbone(backbone)
        if getattr(backbone, "mask_token", None) is None:
            raise ValueError("SimMIM feeds a learned mask token to the encoder: build the ViT "
                             "with mask_token=True (backbone.init_args.mask_token: true).")
        self.patch_size, self.num_prefix_tokens = vit.patch_size, vit.num_prefix_tokens
        unit = mask_patch_size or self.patch_size
        if unit % self.patch_size:
            raise ValueError(f"mask_patch_size ({unit}) must be a multiple of the ViT's "
                             f"patch_size ({self.patch_size}).")
        self.masking = RandomUnitMasking(grid, unit // self.patch_size, mask_ratio)
        self.decoder = nn.Linear(self.feature_dim, self.patch_size ** 2 * 3)

    def build_criterion(self) -> nn.Module:
        return SimMIMLoss()

    def draw_masks(self, batch: int) -> Tensor:
        """(B, N) bool masks (True: masked) of this rank's samples: from their keys inside a
        keyed forward, else from the CPU stream shared by the ranks."""
        keys = active_keys()
        if keys is not None:
            return self.masking(batch, seeds=keys.streams(0))
        world, rank = layout(self)
        return self.masking(batch, world, rank)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        x = check_views(views, self.image_size, "SimMIM")
        mask = self.draw_masks(x.shape[0]).to(x.device)
        tokens = as_token_backbone(self.backbone).forward_tokens(x, mask=mask)
        masked = mask.nonzero()[:, 1].view(len(mask), -1)  # (B, M): equal counts per sample
        patch_tokens = tokens[:, self.num_prefix_tokens:]
        chosen = patch_tokens.gather(1, masked.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        pixels = patchify(x, self.patch_size)
        patches = pixels.gather(1, masked.unsqueeze(-1).expand(-1, -1, pixels.shape[-1]))
        with torch.no_grad():
            features = self.backbone(x)
        return {"predictions": self.decoder(chosen), "patches": patches, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["predictions"], outputs["patches"])
