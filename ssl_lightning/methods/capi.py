"""CAPI: Darcet, Baldassarre, Oquab, Mairal & Bojanowski, "Cluster and Predict Latent Patches for
Improved Masked Image Modeling", arXiv 2502.08769, 2025.

One view per image. Per sample, ``mask_ratio`` (65 %) of the patches is masked, all but one
rolled rectangle (:class:`~ssl_lightning.masking.InverseBlockMasking`, the official default;
``mask_generator="uniform"``: :class:`~ssl_lightning.masking.RandomMasking`), and a random
``prediction_subsampling`` (5 %) of the masked patches is predicted. The student encoder
(``backbone``, a ViT with registers) sees the visible patches; a predictor of cross-attention
blocks (:class:`~ssl_lightning.heads.CrossAttentionPredictor`) puts a mask token at each
predicted position that attends to the student's tokens, and a weight-normalised head on
L2-normalised inputs (:class:`~ssl_lightning.heads.L2NormLinear`) gives K cluster logits. The
teacher, an EMA of the student (momentum 0.999 → 1), sees the whole image; its patch tokens go
through the online clustering layer (L2-normalised, K prototypes with a bias), whose
positionwise Sinkhorn codes are the targets (:class:`~ssl_lightning.losses.CAPILoss`). The
clustering layer is trained by the clustering loss only, with its own lr (half the encoder's)
and weight decay (AdamW's default 0.01), as the official code's second optimiser does.

Features for kNN, the online probe and ``validation_step`` are the teacher's pooled output of the
unmasked image (configure the ViT with ``pool: mean``); in training they come from the teacher
forward. ``LinearEval`` reads them with ``checkpoint_prefix: teacher_backbone.``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.tokens import as_token_backbone, check_views, layout, token_grid
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.heads import CrossAttentionPredictor, L2NormLinear
from ssl_lightning.losses import CAPILoss
from ssl_lightning.masking import InverseBlockMasking, RandomMasking
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.ema import momentum_teacher
from ssl_lightning.training.sample_rng import active_keys


@register_method(
    "capi", title="CAPI", configs=("capi.yaml",),
    paper=Paper("Cluster and Predict Latent Patches for Improved Masked Image Modeling", 2025,
                "2502.08769"),
    family="masked", views=(8,), tests="tests/methods/test_capi.py",
    backbone=lambda: small_vit(num_registers=1, pool="mean"),
    matrix_args={
        "capi.yaml": ("--model.init_args.predictor_depth", "1",
                      "--model.init_args.predictor_heads", "2",
                      "--model.init_args.num_clusters", "8"),
    },
    small=lambda backbone, **kw: CAPI(backbone, num_clusters=8, predictor_dim=16,
                                      predictor_depth=1, predictor_heads=2,
                                      prediction_subsampling=0.5, momentum_base=0.9,
                                      image_size=8, **kw),
)
class CAPI(MomentumMethod):
    """CAPI.

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT` (the student encoder; the teacher is
            its EMA copy); ``image_size`` must be its image size.
        num_clusters: Clusters K of the online clustering and the student head (16384).
        mask_ratio: Fraction of the patches masked per sample, in (0, 1) (0.65).
        mask_generator: ``"inverse_block"`` (visible patches in one rolled rectangle, the
            official default) or ``"uniform"`` (MAE's random patches).
        prediction_subsampling: Fraction of the masked patches predicted, in (0, 1] (0.05).
        predictor_dim: Predictor width (the encoder's: 1024 for ViT-L).
        predictor_depth: Predictor blocks (12).
        predictor_heads: Predictor heads (16).
        target_temperature: Sinkhorn temperature of the teacher's logits (0.06).
        student_temperature: Temperature of the student's logits (0.12).
        clustering_temperature: Temperature of the teacher's logits in the clustering loss
            (0.12).
        sinkhorn_iterations: Sinkhorn-Knopp rounds (3).
        clustering_lr_multiplier: The clustering layer's peak lr / the encoder's (5e-4 / 1e-3).
        clustering_weight_decay: The clustering layer's weight decay (0.01, AdamW's default
            in the official code).
        momentum_base: Teacher EMA momentum at step 0 (0.999), cosine to 1.
        optimizer: ``"adamw"``.
        lr: Peak lr (1e-3 at batch 16384, no scaling rule in the official code).
        weight_decay: 0.1.
        betas: AdamW betas (0.9, 0.95).
        warmup_epochs: Warm-up (the official code: 10 % of training).
        final_lr_ratio: Last lr / peak (the official cosine is cut at 80 %: 0.095).
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    #: Batches without sample seeds: every rank draws the global batch's masks from one CPU
    #: stream and takes its rows.
    rng_shared_across_ranks = True

    def __init__(
        self,
        backbone: nn.Module,
        num_clusters: int = 16384,
        mask_ratio: float = 0.65,
        mask_generator: Literal["inverse_block", "uniform"] = "inverse_block",
        prediction_subsampling: float = 0.05,
        predictor_dim: int = 1024,
        predictor_depth: int = 12,
        predictor_heads: int = 16,
        target_temperature: float = 0.06,
        student_temperature: float = 0.12,
        clustering_temperature: float = 0.12,
        sinkhorn_iterations: int = 3,
        clustering_lr_multiplier: float = 0.5,
        clustering_weight_decay: float = 0.01,
        momentum_base: float = 0.999,
        optimizer: OptimizerName = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_epochs: float = 10.0,
        final_lr_ratio: float = 0.095,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, momentum_base=momentum_base, optimizer=optimizer, lr=lr,
                         weight_decay=weight_decay, betas=betas, warmup_epochs=warmup_epochs,
                         final_lr_ratio=final_lr_ratio, **kwargs)
        if num_clusters < 1:
            raise ValueError(f"CAPI num_clusters must be >= 1, got {num_clusters}.")
        if clustering_lr_multiplier <= 0 or clustering_weight_decay < 0:
            raise ValueError("CAPI clustering_lr_multiplier must be > 0 and "
                             "clustering_weight_decay >= 0, got "
                             f"{clustering_lr_multiplier} and {clustering_weight_decay}.")
        grid = token_grid(backbone, self.image_size, "CAPI")
        if mask_generator not in ("inverse_block", "uniform"):
            raise ValueError("CAPI mask_generator must be 'inverse_block' or 'uniform', got "
                             f"{mask_generator!r}.")
        self.masking = (InverseBlockMasking(grid, mask_ratio) if mask_generator == "inverse_block"
                        else RandomMasking(grid ** 2, mask_ratio))  # both validate the ratio
        masked = grid ** 2 - self.masking.num_keep
        self.num_predict = int(masked * prediction_subsampling)
        if not 0 < prediction_subsampling <= 1 or self.num_predict < 1:
            raise ValueError(f"CAPI prediction_subsampling {prediction_subsampling} predicts "
                             f"{self.num_predict} of the {masked} masked patches; choose a "
                             "fraction in (0, 1] that predicts at least one.")
        self.num_prefix_tokens = as_token_backbone(backbone).num_prefix_tokens
        self.clustering_lr_multiplier = clustering_lr_multiplier
        self.clustering_weight_decay = clustering_weight_decay
        self.target_temperature, self.student_temperature = target_temperature, student_temperature
        self.clustering_temperature = clustering_temperature
        self.sinkhorn_iterations = sinkhorn_iterations
        self.predictor = CrossAttentionPredictor(self.feature_dim, grid, predictor_dim,
                                                 predictor_depth, predictor_heads)
        self.head = L2NormLinear(predictor_dim, num_clusters)
        self.clustering = L2NormLinear(self.feature_dim, num_clusters, bias=True,
                                       weight_norm=False)
        self.teacher_backbone = momentum_teacher(self.backbone)
        for module in self.teacher_backbone.modules():
            if isinstance(module, DropPath):  # the teacher runs in eval mode officially
                module.drop_prob = 0.0

    def build_criterion(self) -> nn.Module:
        return CAPILoss(self.target_temperature, self.student_temperature,
                        self.clustering_temperature, self.sinkhorn_iterations)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone)]

    def param_groups(self) -> list[dict]:
        """The encoder, predictor and head with the method's lr and decay; the clustering layer
        with its own (the official code's second optimiser)."""
        modules = [m for m in self.trainable_modules() if m is not self.clustering]
        return [*self.decay_groups(modules),
                {"params": list(self.clustering.parameters()),
                 "weight_decay": self.clustering_weight_decay,
                 "lr_multiplier": self.clustering_lr_multiplier}]

    def draw_masks(self, batch: int) -> tuple[Tensor, Tensor]:
        """``(visible, predicted)`` patch indices (B, K) and (B, P) of this rank's samples:
        from their keys inside a keyed forward, else from the CPU stream shared by the ranks.
        The masked indices come in random order, so their first P are a random subset."""
        keys = active_keys()
        if keys is not None:
            keep, masked = self.masking(batch, seeds=keys.streams(0))
        else:
            world, rank = layout(self)
            keep, masked = self.masking(batch, world, rank)
        return keep, masked[:, :self.num_predict]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        x = check_views(views, self.image_size, "CAPI")
        visible, predict = (m.to(x.device) for m in self.draw_masks(x.shape[0]))
        teacher = as_token_backbone(self.teacher_backbone)
        with torch.no_grad():
            tokens = teacher.forward_tokens(x)
            features = teacher.pool_tokens(tokens)
            teacher_patches = tokens[:, self.num_prefix_tokens:]
        context = as_token_backbone(self.backbone).forward_tokens(x, keep=visible)
        student_logits = self.head(self.predictor(context, predict))
        return {"student_logits": student_logits, "teacher_patches": teacher_patches,
                "predict": predict, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        teacher_logits = self.clustering(outputs["teacher_patches"])
        capi, clustering = self.criterion(outputs["student_logits"], teacher_logits,
                                          outputs["predict"])
        self.log_terms("capi", (("prediction", capi), ("clustering", clustering)),
                       teacher_logits.shape[0])
        return capi + clustering

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        return {"features": self.teacher_backbone(images), "targets": targets}
