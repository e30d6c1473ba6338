"""MSN: Assran et al., "Masked Siamese Networks for Label-Efficient Learning", ECCV 2022.

Views (:class:`~ssl_lightning.data.MultiCropViews`): ``[target, anchor, focal_1, ...]``. The EMA
teacher (backbone + projection head) embeds the unmasked target view; the student embeds the
anchor view with a random ``mask_ratio`` of its patch tokens dropped (the official code's
``patch_drop``: 0.15 for ViT-S/16, the focal views unmasked) and the focal views. Both are
scored against K learnable prototypes (:class:`~ssl_lightning.heads.SwAVPrototypes`, used
unnormalised and normalised in the loss); :class:`~ssl_lightning.losses.MSNLoss` matches the
anchors' predictions to the sharpened, Sinkhorn-balanced teacher prediction, plus the
mean-entropy regulariser over the global batch. Recipe of the official ViT-S/16 config: AdamW,
lr 1e-3 (warm-up 15 epochs), weight decay 0.04 → 0.4, gradient clip 3 on the encoder, EMA
0.996 → 1, prototypes without weight decay.

Masks are drawn per sample from its key (:mod:`~ssl_lightning.training.sample_rng`), so 1 and
N processes and micro-batches drop the same tokens; the prototypes' gradient is the average over
ranks like every other parameter (the official code sums it over ranks, a learning rate W times
larger on W GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.backbones.tokens import as_token_backbone, token_grid
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.distributed import all_reduce_sum_with_grad
from ssl_lightning.heads import SwAVPrototypes, build_mlp
from ssl_lightning.losses import MSNLoss
from ssl_lightning.masking import RandomMasking
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.ema import momentum_teacher
from ssl_lightning.training.sample_rng import active_keys


def msn_projector(in_dim: int, hidden_dim: int, out_dim: int, batch_norm: bool) -> nn.Module:
    """MSN's projection head: 3 linear layers with GELU (BatchNorm in the hidden layers in the
    official ViT configs), truncated-normal (0.02) weights and zero biases."""
    head = build_mlp(in_dim, hidden_dim, out_dim, 3, batch_norm, activation=nn.GELU)
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return head


@register_method(
    "msn", title="MSN", configs=("msn.yaml",),
    paper=Paper("Masked Siamese Networks for Label-Efficient Learning", 2022, "2204.07141"),
    family="clustering", views=MULTI_CROP, tests="tests/methods/test_msn.py",
    backbone=small_vit,
    small=lambda backbone, **kw: MSN(backbone, projection_hidden_dim=16, projection_dim=8,
                                     head_batch_norm=False, num_prototypes=10, mask_ratio=0.25,
                                     image_size=8, momentum_base=0.9, **kw),
)
class MSN(MomentumMethod):
    """Masked Siamese Networks.

    Args:
        backbone: A :class:`~ssl_lightning.backbones.ViT` (any backbone when ``mask_ratio`` is
            0); ``image_size`` must be its image size.
        projection_hidden_dim: Hidden width of the projection head (2048).
        projection_dim: Output of the projection head = prototype dimension (256).
        head_batch_norm: BatchNorm in the projection head (official configs: true; under DDP
            not synchronised on CPU).
        num_prototypes: K (1024).
        temperature: τ of the prototype softmax (0.1).
        sharpen_temperature: T of the target sharpening (0.25).
        sinkhorn_iterations: Sinkhorn rounds on the targets (3; 0: off).
        regularization_weight: λ of the mean-entropy regulariser (1).
        mask_ratio: Fraction of the anchor view's patch tokens dropped, in [0, 1) (0.15).
        clip_grad: Clip of the global gradient norm of backbone and projector (3), or None.
        projector: A module replacing the default projection head (maps features to
            ``projection_dim``).
        **kwargs: Other arguments of :class:`MomentumMethod` / :class:`SSLMethod`.
    """

    views_used = None  # target, anchor and every focal view

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 256,
        head_batch_norm: bool = True,
        num_prototypes: int = 1024,
        temperature: float = 0.1,
        sharpen_temperature: float = 0.25,
        sinkhorn_iterations: int = 3,
        regularization_weight: float = 1.0,
        mask_ratio: float = 0.15,
        clip_grad: float | None = 3.0,
        projector: nn.Module | None = None,
        optimizer: OptimizerName = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.04,
        weight_decay_end: float | None = 0.4,
        warmup_epochs: float = 15.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                         weight_decay_end=weight_decay_end, warmup_epochs=warmup_epochs,
                         **kwargs)
        name = type(self).__name__
        if not 0 <= mask_ratio < 1:
            raise ValueError(f"{name} mask_ratio must be in [0, 1), got {mask_ratio}.")
        if mask_ratio > 0:  # fails here, before training, for a backbone or ratio that can't
            grid = token_grid(backbone, self.image_size, name)
            RandomMasking(grid * grid, mask_ratio)
        if clip_grad is not None and not clip_grad > 0:
            raise ValueError(f"{name} clip_grad must be > 0 or None, got {clip_grad}.")
        self.projector = self.build_head(
            "projector", projector,
            lambda: msn_projector(self.feature_dim, projection_hidden_dim, projection_dim,
                                  head_batch_norm),
            self.feature_dim, projection_dim, "projection_dim")
        self.prototypes = SwAVPrototypes(projection_dim, num_prototypes)
        self.teacher_backbone = momentum_teacher(self.backbone)
        for module in self.teacher_backbone.modules():
            if isinstance(module, DropPath):  # the target encoder has no stochastic depth
                module.drop_prob = 0.0
        self.teacher_projector = momentum_teacher(self.projector)
        self.temperature, self.sharpen_temperature = temperature, sharpen_temperature
        self.sinkhorn_iterations = sinkhorn_iterations
        self.regularization_weight = regularization_weight
        self.mask_ratio, self.clip_grad = mask_ratio, clip_grad

    def build_criterion(self) -> nn.Module:
        return MSNLoss(self.temperature, self.sharpen_temperature, self.sinkhorn_iterations,
                       self.regularization_weight)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def draw_keep(self, batch: int, num_patches: int, device: torch.device) -> Tensor:
        """(B, K) kept patch indices of the anchor view: from each sample's key inside a keyed
        forward, else from torch's (per-batch reseeded) generator."""
        keys = active_keys()
        masking = RandomMasking(num_patches, self.mask_ratio)
        keep, _ = masking(batch, seeds=None if keys is None else keys.streams(0))
        return keep.to(device)

    def embed_anchor(self, x: Tensor) -> Tensor:
        """Backbone features of the anchor view with its patch tokens dropped."""
        if self.mask_ratio == 0:
            return self.backbone(x)
        vit = as_token_backbone(self.backbone)
        num_patches = (x.shape[-2] // vit.patch_size) * (x.shape[-1] // vit.patch_size)
        keep = self.draw_keep(x.shape[0], num_patches, x.device)
        return vit.pool_tokens(vit.forward_tokens(x, keep=keep))

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views, 2)
        if views[0].shape != views[1].shape:
            raise ValueError(f"{type(self).__name__}'s target and anchor views (the 2 global "
                             f"crops) must have one shape, got {tuple(views[0].shape)} and "
                             f"{tuple(views[1].shape)}.")
        batch = views[0].shape[0]
        features = self.embed_anchor(views[1])
        if len(views) > 2:
            features = torch.cat([features, forward_by_resolution(self.backbone, views[2:])])
        anchors = self.projector(features).unflatten(0, (-1, batch)).transpose(0, 1)
        with torch.no_grad():
            teacher_features = self.teacher_backbone(views[0])
            targets = self.teacher_projector(teacher_features)
        return {"anchors": anchors, "targets": targets, "features": teacher_features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        cross_entropy, regularizer = self.criterion.terms(
            outputs["anchors"], outputs["targets"], self.prototypes.forward_weight(),
            all_reduce_sum_with_grad)
        self.log_terms("msn", (("cross_entropy", cross_entropy), ("regularizer", regularizer)),
                       outputs["targets"].shape[0])
        return cross_entropy + self.criterion.regularization_weight * regularizer

    def param_groups(self) -> list[dict]:
        """The decay groups, and the prototypes without weight decay (official code)."""
        modules = [m for m in self.trainable_modules() if m is not self.prototypes]
        return [*self.decay_groups(modules),
                {"params": list(self.prototypes.parameters()), "weight_decay": 0.0,
                 "exclude_from_lars": True}]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the encoder's (backbone + projector) gradient norm, then the weight-decay
        schedule."""
        clip = self.clip_grad
        if clip is not None:
            params = [p for m in (self.backbone, self.projector) for p in m.parameters()
                      if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, clip)
        super().on_before_optimizer_step(optimizer)
