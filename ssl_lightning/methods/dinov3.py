"""DINOv3: Siméoni et al., "DINOv3", arXiv 2508.10104, 2025.

:class:`~ssl_lightning.methods.dinov2.DINOv2` (DINO + iBOT losses, Sinkhorn centring, KoLeo)
with DINOv3's recipe (§3.2, §4, and the official ``configs/train/*.yaml``): constant schedules
after the warm-up (``final_lr_ratio=1``, constant weight decay 0.04, constant teacher momentum
0.994), AdamW with beta2 = 0.99, gradient clipping 30 per module, no frozen last layer in the
continued stages, and the Gram anchoring stage: :class:`~ssl_lightning.losses.GramLoss` between the
student's patch tokens of its (masked) global crops and those of a
:class:`~ssl_lightning.training.gram_teacher.GramTeacher` (a snapshot of the EMA teacher taken at
``gram_start_step`` and refreshed every ``gram_refresh_every`` steps, at most
``gram_max_refreshes`` times), weighted by ``gram_weight`` after a cosine ramp of
``gram_weight_ramp_steps`` from 0.

Views: ``[global_1, global_2, local_1 … local_V]`` and, optionally, two Gram-teacher crops of the
global crops at a higher resolution (:class:`~ssl_lightning.data.gram_crops.GramCropViews`);
without them the Gram teacher sees the global crops. Its patch features are resized (bicubic)
to the student's grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ssl_lightning.losses import GramLoss
from ssl_lightning.losses.gram import ClampNegatives
from ssl_lightning.methods.dino import ClipMode
from ssl_lightning.methods.dinov2 import DINOv2
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName, cosine_ramp
from ssl_lightning.training.ema import Schedule
from ssl_lightning.training.gram_teacher import GramTeacher
from ssl_lightning.training.mixed_resolution import MixedResolution
from ssl_lightning.training.step_rng import step_seed

GramTokens = Literal["all", "masked", "unmasked"]


@register_method(
    "dinov3", title="DINOv3", configs=("dinov3.yaml", "dinov3_continue.yaml"),
    paper=Paper("DINOv3", 2025, "2508.10104"),
    family="distillation", views=(8, 8, 4, 16, 16), tests="tests/training/test_gram_teacher.py",
    docs="docs/dinov3.md",
    backbone=lambda: small_vit(mask_token=True, num_registers=1),
    small=lambda backbone, **kw: DINOv3(backbone, head_out_dim=12, head_hidden_dim=16,
                                        head_bottleneck_dim=8, momentum_base=0.9,
                                        warmup_teacher_temperature_epochs=0, shared_head=False,
                                        patch_out_dim=12, num_local_crops=1, patch_hidden_dim=12,
                                        patch_bottleneck_dim=6, gram_start_step=0,
                                        gram_refresh_every=1, gram_max_refreshes=1, image_size=8,
                                        **kw),
)
class DINOv3(DINOv2):
    """DINOv2 with DINOv3's schedules and Gram anchoring.

    Args:
        backbone: A ViT with ``mask_token=True`` (DINOv3: 4 registers).
        head_out_dim: Prototypes of the [CLS] head (262144 in DINOv3's ViT-7B).
        patch_out_dim: Prototypes of the patch head (98304).
        head_hidden_dim: Hidden width of the [CLS] head (8192).
        head_bottleneck_dim: Bottleneck of the [CLS] head (512).
        patch_hidden_dim: Hidden width of the patch head (4096).
        patch_bottleneck_dim: Bottleneck of the patch head (384).
        num_local_crops: Local crops per image (8).
        gram_weight: Weight of the Gram loss once ramped up (2.0 in the Gram stage, 1.5 in
            the high-resolution stage); 0 disables Gram anchoring.
        gram_start_step: Optimiser step of the first Gram-teacher snapshot; the Gram loss is
            off before it.
        gram_refresh_every: Steps between Gram-teacher refreshes (10,000); 0: never.
        gram_max_refreshes: Most refreshes (3); None: no limit.
        gram_weight_ramp_steps: Steps of the cosine ramp 0 → ``gram_weight`` after the start.
        gram_tokens: Patches in the Gram matrices: ``"all"`` (DINOv3), ``"masked"`` or
            ``"unmasked"`` (by the student's iBOT mask).
        gram_clamp_negatives: ``"none"`` (DINOv3), ``"both"`` or ``"teacher"``.
        mixed_resolution_sizes: ``[global, local, gram]`` crop sides, one set drawn per step
            (the high-resolution stage, :class:`~ssl_lightning.training.mixed_resolution.
            MixedResolution`); None: the data's sizes.
        mixed_resolution_ratios: Frequency of each set (default: equal).
        optimizer, betas, clip_grad, clip_grad_mode, momentum_base, momentum_schedule,
        weight_decay, final_lr_ratio, freeze_last_layer_epochs: DINOv3's values by default.
        **kwargs: Other arguments of :class:`DINOv2` / :class:`IBOT` / :class:`DINO`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 262144,
        patch_out_dim: int | None = 98304,
        head_hidden_dim: int = 8192,
        head_bottleneck_dim: int = 512,
        patch_hidden_dim: int | None = 4096,
        patch_bottleneck_dim: int | None = 384,
        num_local_crops: int | None = 8,
        gram_weight: float = 2.0,
        gram_start_step: int = 0,
        gram_refresh_every: int = 10000,
        gram_max_refreshes: int | None = 3,
        gram_weight_ramp_steps: int = 0,
        gram_tokens: GramTokens = "all",
        gram_clamp_negatives: ClampNegatives = "none",
        mixed_resolution_sizes: list[list[int]] | None = None,
        mixed_resolution_ratios: list[float] | None = None,
        optimizer: OptimizerName = "adamw",
        betas: tuple[float, float] = (0.9, 0.99),
        clip_grad: float | None = 30.0,
        clip_grad_mode: ClipMode = "per_module",
        momentum_base: float = 0.994,
        momentum_schedule: Schedule = "constant",
        weight_decay: float = 0.04,
        final_lr_ratio: float = 1.0,
        freeze_last_layer_epochs: int = 0,
        **kwargs: Any,
    ) -> None:
        if gram_weight < 0:
            raise ValueError(f"gram_weight must be >= 0, got {gram_weight}.")
        if gram_weight_ramp_steps < 0:
            raise ValueError(f"gram_weight_ramp_steps must be >= 0, got "
                             f"{gram_weight_ramp_steps}.")
        if gram_tokens not in ("all", "masked", "unmasked"):
            raise ValueError(f"gram_tokens must be 'all', 'masked' or 'unmasked', got "
                             f"{gram_tokens!r}.")
        if num_local_crops is None:
            raise ValueError("DINOv3 needs num_local_crops (an int): the views after the local "
                             "crops are the Gram-teacher crops.")
        mixed = (None if mixed_resolution_sizes is None else MixedResolution(  # before the heads
            mixed_resolution_sizes, mixed_resolution_ratios,
            patch_size=getattr(backbone, "patch_size", None)))
        super().__init__(backbone, head_out_dim=head_out_dim, patch_out_dim=patch_out_dim,
                         head_hidden_dim=head_hidden_dim, head_bottleneck_dim=head_bottleneck_dim,
                         patch_hidden_dim=patch_hidden_dim,
                         patch_bottleneck_dim=patch_bottleneck_dim,
                         num_local_crops=num_local_crops, optimizer=optimizer, betas=betas,
                         clip_grad=clip_grad, clip_grad_mode=clip_grad_mode,
                         momentum_base=momentum_base, momentum_schedule=momentum_schedule,
                         weight_decay=weight_decay, final_lr_ratio=final_lr_ratio,
                         freeze_last_layer_epochs=freeze_last_layer_epochs, **kwargs)
        self.mixed_resolution = mixed
        self.step_sizes: tuple[int, int, int] | None = None
        self.gram_loss = GramLoss(clamp_negatives=gram_clamp_negatives)
        self.gram_teacher = GramTeacher(self.teacher_backbone, gram_start_step,
                                        gram_refresh_every, gram_max_refreshes)

    def trainable_modules(self) -> list[nn.Module]:
        return [m for m in super().trainable_modules() if m is not self.gram_teacher]

    def gram_weight(self, step: int) -> float:
        """Weight of the Gram loss at optimiser step ``step``: 0 before ``gram_start_step``,
        then a cosine ramp to ``gram_weight`` over ``gram_weight_ramp_steps``."""
        hp = self.hparams
        start, ramp = hp["gram_start_step"], hp["gram_weight_ramp_steps"]
        if step < start:
            return 0.0
        if ramp == 0:
            return hp["gram_weight"]
        return cosine_ramp(step - start, ramp, 0.0, hp["gram_weight"])

    def refresh_gram_teacher(self, step: int) -> bool:
        """Snapshot the EMA teacher into the Gram teacher if ``step`` is on its schedule."""
        return self.gram_teacher.refresh(step, self.teacher_backbone)

    def on_fit_start(self) -> None:
        """Also refuse, before the first step, mixed-resolution sizes larger than the data's
        crops (the train transform's ``global_size``, ``local_size``, ``gram_size``)."""
        super().on_fit_start()
        transform = getattr(getattr(self.trainer, "datamodule", None), "train_transform", None)
        if self.mixed_resolution is not None and transform is not None:
            self.mixed_resolution.check_crops([getattr(transform, f"{n}_size", None)
                                               for n in ("global", "local", "gram")])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Reseed (see :class:`SSLMethod`), then refresh the Gram teacher on its schedule:
        the EMA update of the previous step is done and ``global_step`` counts it."""
        super().on_train_batch_start(batch, batch_idx)
        self.refresh_gram_teacher(self.global_step)
        if self.mixed_resolution is not None:
            seed = step_seed(self.rng_seed, self.current_epoch, batch_idx, 0)  # rank-free
            self.step_sizes = self.mixed_resolution.draw(seed)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        n_views = 2 + self.hparams["num_local_crops"]
        if len(views) not in (n_views, n_views + 2):
            raise ValueError(f"DINOv3 needs 2 global + {n_views - 2} local views (+ 2 Gram-"
                             f"teacher crops), got {len(views)} views.")
        if self.step_sizes is not None:
            views = MixedResolution.resize(views, n_views - 2, self.step_sizes)
        outputs = super().forward_views(views[:n_views])
        if self.gram_weight(self.global_step) > 0:
            gram_crops = views[n_views:] or views[:2]
            patch = cast(Any, self.backbone).patch_size
            grid = (views[0].shape[-2] // patch, views[0].shape[-1] // patch)
            outputs["gram_teacher_patches"] = torch.stack(  # (B, 2, N, D), per sample
                [self.gram_teacher.patch_features(c, grid) for c in gram_crops], dim=1)
        return outputs

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        loss = super().loss_from_outputs(outputs)
        weight = self.gram_weight(self.global_step)
        if weight == 0:
            return loss
        tokens = self.hparams["gram_tokens"]
        masks = outputs["masks"].flatten(0, 1)
        token_mask = None if tokens == "all" else masks if tokens == "masked" else ~masks
        gram = self.gram_loss(outputs["patch_tokens"].flatten(0, 1),
                              outputs["gram_teacher_patches"].flatten(0, 1), token_mask)
        self.log_terms(gram_loss=gram, gram_weight=weight)
        return loss + weight * gram
