"""I-JEPA: Assran et al., "Self-Supervised Learning from Images with a Joint-Embedding
Predictive Architecture", CVPR 2023.

One view per image. Per sample, :class:`~ssl_lightning.masking.MultiBlockMasking`
draws 4 target blocks (scale 0.15-0.2, aspect 0.75-1.5) and a context block (scale 0.85-1.0)
with the target patches removed (§3). The context encoder (``backbone``) sees the context
patches only; the target encoder, an EMA of it (momentum 0.996 → 1, cosine, through
:class:`~ssl_lightning.callbacks.EMACallback`), sees the whole image under ``no_grad``; a narrow
ViT predictor (:class:`~ssl_lightning.heads.MaskedPredictor`) predicts, for each target block
separately, the target encoder's patch representations, which
:class:`~ssl_lightning.losses.IJEPALoss` layer-normalises and compares (MSE or smooth-L1).

Features for kNN, the online probe and ``validation_step`` are the target encoder's pooled
output of the unmasked image (the paper evaluates the target encoder, average-pooled: configure
the ViT with ``pool: mean``); in training they come for free from the target forward.
``LinearEval`` reads them with ``checkpoint_prefix: teacher_backbone.``.
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
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.heads import MaskedPredictor
from ssl_lightning.losses import IJEPALoss
from ssl_lightning.losses.ijepa import Distance
from ssl_lightning.masking import MultiBlockMasking, Range
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.ema import momentum_teacher
from ssl_lightning.training.grad_cache import whole_batch_draw
from ssl_lightning.training.sample_rng import active_keys


@register_method(
    "ijepa", title="I-JEPA", configs=("ijepa.yaml",),
    paper=Paper("Self-Supervised Learning from Images "
                "with a Joint-Embedding Predictive Architecture",
                2023, "2301.08243"),
    family="predictive", views=(8,), tests="tests/methods/test_ijepa.py",
    docs="docs/masked_image_modeling.md",
    backbone=lambda: small_vit(pool="mean"),
    cli_args={
        "ijepa.yaml": ("--model.init_args.backbone.init_args.depth", "1",
                       "--model.init_args.predictor_depth", "1"),
    },
    matrix_args={
        "ijepa.yaml": ("--model.init_args.predictor_depth", "1",
                       "--model.init_args.predictor_heads", "2"),
    },
    small=lambda backbone, **kw: IJEPA(backbone, predictor_dim=16, predictor_depth=1,
                                       predictor_heads=2, momentum_base=0.9, min_context=2,
                                       image_size=8, **kw),
)
class IJEPA(MomentumMethod):
    """I-JEPA.

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT` (the context encoder); ``image_size``
            must be its image size.
        predictor_dim: Predictor width (384 in the paper).
        predictor_depth: Predictor blocks (12 for ViT-H/14; 6 in the code's default).
        predictor_heads: Predictor heads (the code uses the encoder's: 16 for ViT-H).
        num_targets: Target blocks per image (4).
        target_scale: Target block area range (0.15, 0.2).
        target_aspect: Target block aspect range (0.75, 1.5).
        context_scale: Context block area range (0.85, 1.0).
        min_context: Fewest context patches (the code's ``min_keep``, 10).
        mask_seed: Seed of the per-step block-size generator (see :class:`MultiBlockMasking`).
        distance: ``"mse"`` (the paper's Eq. 1) or ``"smooth_l1"`` (the paper's code).
        momentum_base: Target-encoder EMA momentum at step 0 (0.996), cosine to 1.
        optimizer: ``"adamw"`` as in the paper's code.
        lr: Base lr for the ``linear`` rule: 1e-3 at batch 2048 is 1.25e-4 per 256.
        weight_decay: 0.04 at step 0, raised by a cosine to ...
        weight_decay_end: ... 0.4 at the last step (the code's ``final_weight_decay``; None:
            constant ``weight_decay``).
        warmup_epochs: 40 (the code warms up from 2e-4, not from 0).
        final_lr_ratio: 1e-3 (1e-6 / 1e-3 in the code).
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    #: A mean of per-sample terms: gradient accumulation keeps the objective (no warning).
    batch_coupled_loss = False
    #: Batches without sample seeds: every rank draws the global batch's masks from one CPU
    #: stream and takes its rows.
    rng_shared_across_ranks = True

    def __init__(
        self,
        backbone: nn.Module,
        predictor_dim: int = 384,
        predictor_depth: int = 12,
        predictor_heads: int = 16,
        num_targets: int = 4,
        target_scale: Range = (0.15, 0.2),
        target_aspect: Range = (0.75, 1.5),
        context_scale: Range = (0.85, 1.0),
        min_context: int = 10,
        mask_seed: int = 0,
        distance: Distance = "mse",
        momentum_base: float = 0.996,
        optimizer: OptimizerName = "adamw",
        lr: float = 1.25e-4,
        weight_decay: float = 0.04,
        weight_decay_end: float | None = 0.4,
        warmup_epochs: float = 40.0,
        final_lr_ratio: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, momentum_base=momentum_base, optimizer=optimizer, lr=lr,
                         weight_decay=weight_decay, weight_decay_end=weight_decay_end,
                         warmup_epochs=warmup_epochs, final_lr_ratio=final_lr_ratio, **kwargs)
        grid = token_grid(backbone, self.image_size, "IJEPA")
        self.num_prefix_tokens = as_token_backbone(backbone).num_prefix_tokens
        self.masking = MultiBlockMasking(grid, num_targets, target_scale, target_aspect,
                                         context_scale, min_context, mask_seed)
        self.predictor = MaskedPredictor(self.feature_dim, self.feature_dim, grid,
                                         predictor_dim, predictor_depth, predictor_heads)
        self.teacher_backbone = momentum_teacher(self.backbone)
        for module in self.teacher_backbone.modules():
            if isinstance(module, DropPath):  # the target encoder has no stochastic depth
                module.drop_prob = 0.0
        self.distance = distance

    def build_criterion(self) -> nn.Module:
        return IJEPALoss(self.distance)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone)]

    def draw_masks(self, batch: int) -> tuple[Tensor, Tensor]:
        """``(context, targets)``: (B, K) and (B, M, n) patch indices of this rank's samples,
        block sizes of the current optimiser step; positions from the samples' keys inside a
        keyed forward, else from the CPU stream shared by the ranks (once for the whole batch
        under gradient caching)."""
        keys = active_keys()
        if keys is not None:
            return self.masking(batch, self.global_step, seeds=keys.streams(0))
        world, rank = layout(self)
        return whole_batch_draw("ijepa_masks", batch,
                                lambda n: self.masking(n, self.global_step, world, rank))

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        x = check_views(views, self.image_size, "IJEPA")
        context, targets = (m.to(x.device) for m in self.draw_masks(x.shape[0]))
        b, m, n = targets.shape
        prefix = self.num_prefix_tokens
        target = as_token_backbone(self.teacher_backbone)
        with torch.no_grad():
            tokens = target.forward_tokens(x)
            features = target.pool_tokens(tokens)
            patch_tokens = tokens[:, prefix:]
            index = targets.reshape(b, m * n, 1).expand(-1, -1, patch_tokens.shape[-1])
            target_tokens = patch_tokens.gather(1, index).view(b, m, n, -1)
        encoder = as_token_backbone(self.backbone)
        context_tokens = encoder.forward_tokens(x, keep=context)[:, prefix:]
        predictions = self.predictor(context_tokens.repeat_interleave(m, dim=0),
                                     context.repeat_interleave(m, dim=0), targets.view(b * m, n))
        return {"predictions": predictions.view(b, m, n, -1), "targets": target_tokens,
                "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["predictions"], outputs["targets"])

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        return {"features": self.teacher_backbone(images), "targets": targets}
