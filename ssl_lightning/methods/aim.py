"""AIM: El-Nouby et al., "Scalable Pre-training of Large Autoregressive Image Models",
ICML 2024.

One view per image. The ViT runs with prefix-causal attention (``forward_tokens(x,
causal_prefix=S)``, :mod:`ssl_lightning.backbones.prefix_causal`): per sample a prefix length S
is drawn uniformly from {min_prefix, ..., max_prefix} (the paper: {1, ..., K − 1}); the first S
patches attend bidirectionally, the rest causally in raster order. An MLP head applied to each
patch token predicts the next patch's pixels, and :class:`~ssl_lightning.losses.AIMLoss`
regresses the per-patch normalised pixels of the non-prefix patches (§3). AdamW (betas 0.9,
0.95), weight decay 0.05, cosine decay after a warm-up.

Features for kNN and the online probe are those of the same ViT with bidirectional attention
(``backbone(x)``, the paper's downstream use of a prefix-trained model), under ``no_grad``: one
extra encoder forward per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.tokens import as_token_backbone, check_views, layout, token_grid
from ssl_lightning.heads.mlp import build_mlp
from ssl_lightning.losses import AIMLoss
from ssl_lightning.losses.mae import patchify
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.sample_rng import active_keys, keyed_uniform


@register_method(
    "aim", title="AIM", configs=("aim.yaml",),
    paper=Paper("Scalable Pre-training of Large Autoregressive Image Models", 2024, "2401.08541"),
    family="predictive", views=(8,), tests="tests/methods/test_aim.py",
    backbone=lambda: small_vit(),
    small=lambda backbone, **kw: AIM(backbone, head_hidden_dim=16, head_layers=2, image_size=8,
                                     **kw),
)
class AIM(SSLMethod):
    """Autoregressive next-patch prediction with a prefix-causal ViT.

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT`; ``image_size`` must be its image size.
        min_prefix: Shortest prefix S in patches, >= 1 (1).
        max_prefix: Longest prefix, < the number of patches K (None: K − 1): at least one
            patch is always predicted.
        norm_pix_loss: Regress per-patch normalised pixels (the paper's target).
        head_hidden_dim: Width of the MLP prediction head's hidden layers.
        head_layers: Linear layers of the head (GELU between them).
        optimizer: ``"adamw"`` as in the paper.
        lr: Base lr for the ``linear`` scaling rule, per 256 images.
        weight_decay: 0.05.
        betas: AdamW betas (0.9, 0.95).
        warmup_epochs: Linear warm-up.
        **kwargs: Other arguments of :class:`SSLMethod`.
    """

    #: A mean of per-sample terms: gradient accumulation keeps the objective (no warning).
    batch_coupled_loss = False
    #: Batches without sample seeds: every rank draws the global batch's prefixes from one CPU
    #: stream and takes its rows.
    rng_shared_across_ranks = True

    def __init__(
        self,
        backbone: nn.Module,
        min_prefix: int = 1,
        max_prefix: int | None = None,
        norm_pix_loss: bool = True,
        head_hidden_dim: int = 2048,
        head_layers: int = 3,
        optimizer: OptimizerName = "adamw",
        lr: float = 6.25e-5,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_epochs: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                         betas=betas, warmup_epochs=warmup_epochs, **kwargs)
        patches = token_grid(backbone, self.image_size, "AIM") ** 2
        top = patches - 1 if max_prefix is None else max_prefix
        if not 1 <= min_prefix <= top < patches:
            raise ValueError(
                f"AIM needs 1 <= min_prefix ({min_prefix}) <= max_prefix ({top}) < the number of "
                f"patches ({patches}): the prefix keeps at least one patch and leaves at least "
                "one to predict.")
        self.prefix_range = (min_prefix, top)
        vit = as_token_backbone(backbone)
        self.patch_size, self.num_prefix_tokens = vit.patch_size, vit.num_prefix_tokens
        self.head = build_mlp(self.feature_dim, head_hidden_dim, self.patch_size ** 2 * 3,
                              head_layers, batch_norm=False, activation=nn.GELU)
        self.norm_pix_loss = norm_pix_loss

    def build_criterion(self) -> nn.Module:
        return AIMLoss(self.norm_pix_loss)

    def draw_prefix(self, batch: int) -> Tensor:
        """(B,) int64 prefix lengths of this rank's samples: from their keys inside a keyed
        forward, else from the CPU stream shared by the ranks."""
        keys = active_keys()
        if keys is not None:
            uniform = keyed_uniform(keys.streams(0).cpu(), 1)[:, 0]
        else:
            world, rank = layout(self)
            uniform = torch.rand(world, batch, dtype=torch.float64)[rank]
        low, high = self.prefix_range
        return low + (uniform * (high - low + 1)).long()

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        x = check_views(views, self.image_size, "AIM")
        prefix = self.draw_prefix(x.shape[0]).to(x.device)
        tokens = as_token_backbone(self.backbone).forward_tokens(x, causal_prefix=prefix)
        predictions = self.head(tokens[:, self.num_prefix_tokens:-1])  # position k -> patch k+1
        with torch.no_grad():
            features = self.backbone(x)
        return {"predictions": predictions, "patches": patchify(x, self.patch_size),
                "prefix": prefix, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["predictions"], outputs["patches"], outputs["prefix"])
