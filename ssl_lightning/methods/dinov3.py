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

:class:`DINOv3` is a preset of :class:`~ssl_lightning.methods.DINO` (``gram_anchoring=True``): the
terms and their arguments are documented there.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.losses.centering import Centering
from ssl_lightning.methods.dino import DINO
from ssl_lightning.methods.registry import SMALL_DINO_ARGS, Paper, register_method, small_vit
from ssl_lightning.optim import OptimizerName
from ssl_lightning.training.dino_arguments import ClipMode, require_local_crops
from ssl_lightning.training.ema import Schedule

#: The patch head's own small sizes, and Gram anchoring from the first step (config tests).
SMALL_PATCH_HEAD_ARGS = ("--model.init_args.patch_hidden_dim", "32",
                         "--model.init_args.patch_bottleneck_dim", "16",
                         "--model.init_args.gram_start_step", "0")


@register_method(
    "dinov3", title="DINOv3", configs=("dinov3.yaml", "dinov3_continue.yaml"),
    paper=Paper("DINOv3", 2025, "2508.10104"),
    family="distillation", views=(8, 8, 4, 16, 16), tests="tests/methods/test_dinov3.py",
    docs="docs/dinov3.md",
    backbone=lambda: small_vit(mask_token=True, num_registers=1),
    cli_args={
        "dinov3.yaml": (*SMALL_DINO_ARGS, *SMALL_PATCH_HEAD_ARGS),
        # the shape of the released-backbone file the config test writes
        "dinov3_continue.yaml": (*SMALL_DINO_ARGS, *SMALL_PATCH_HEAD_ARGS,
                                 "--model.init_args.backbone.init_args.embed_dim", "32",
                                 "--model.init_args.backbone.init_args.num_heads", "2",
                                 *[f"--data.init_args.train_transform.init_args.{k}_size={v}"
                                   for k, v in (("global", 32), ("local", 16), ("gram", 64))]),
    },
    matrix_args={
        # the Gram stage inside the matrix's 4 steps: snapshots at steps 1 and 3 (one across
        # the resume)
        "dinov3.yaml": ("--model.init_args.gram_start_step", "1",
                        "--model.init_args.gram_refresh_every", "2",
                        "--model.init_args.gram_weight_ramp_steps", "1"),
    },
    small=lambda backbone, **kw: DINOv3(backbone, head_out_dim=12, head_hidden_dim=16,
                                        head_bottleneck_dim=8, momentum_base=0.9,
                                        warmup_teacher_temperature_epochs=0, shared_head=False,
                                        patch_out_dim=12, num_local_crops=1, patch_hidden_dim=12,
                                        patch_bottleneck_dim=6, gram_start_step=0,
                                        gram_refresh_every=1, gram_max_refreshes=1, image_size=8,
                                        **kw),
    position_keyed=True,
)
class DINOv3(DINO):
    """DINOv2's terms with DINOv3's schedules and Gram anchoring (a preset of :class:`DINO`).

    Args:
        backbone: A ViT with ``mask_token=True`` (DINOv3: 4 registers).
        head_out_dim: Prototypes of the [CLS] head (262144 in DINOv3's ViT-7B).
        patch_out_dim: Prototypes of the patch head (98304).
        head_hidden_dim: Hidden width of the [CLS] head (8192).
        head_bottleneck_dim: Bottleneck of the [CLS] head (512).
        patch_hidden_dim: Hidden width of the patch head (4096).
        patch_bottleneck_dim: Bottleneck of the patch head (384).
        num_local_crops: Local crops per image (8).
        patch_distillation: iBOT's masked-patch loss (on, as in DINOv2).
        shared_head: False: DINOv2's separate patch head.
        centering: ``"sinkhorn"`` (DINOv2's Sinkhorn-Knopp) or ``"center"``.
        koleo_weight: Weight of the KoLeo term (0.1, as in DINOv2).
        mask_ratio_stratified: True (DINOv2's stratified mask ratios, see :class:`DINO`).
        gram_anchoring: The Gram loss against the Gram teacher (on).
        optimizer: AdamW (DINOv3).
        betas: AdamW's betas (0.9, 0.99).
        clip_grad: Gradient-norm clip (30).
        clip_grad_mode: ``"per_module"`` (DINOv3's code).
        momentum_base: Teacher EMA momentum (0.994), constant.
        momentum_schedule: ``"constant"`` (DINOv3).
        weight_decay: Constant weight decay (0.04).
        final_lr_ratio: 1: a constant learning rate after the warm-up.
        freeze_last_layer_epochs: 0: no frozen last layer in the continued stages.
        **kwargs: Other arguments of :class:`DINO` (the ``gram_*`` schedule, mixed resolution).
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
        patch_distillation: bool = True,
        shared_head: bool = False,
        centering: Centering = "sinkhorn",
        koleo_weight: float = 0.1,
        mask_ratio_stratified: bool = True,
        gram_anchoring: bool = True,
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
        require_local_crops(type(self).__name__, num_local_crops)
        super().__init__(backbone, head_out_dim=head_out_dim, patch_out_dim=patch_out_dim,
                         head_hidden_dim=head_hidden_dim, head_bottleneck_dim=head_bottleneck_dim,
                         patch_hidden_dim=patch_hidden_dim,
                         patch_bottleneck_dim=patch_bottleneck_dim,
                         num_local_crops=num_local_crops, patch_distillation=patch_distillation,
                         shared_head=shared_head, centering=centering, koleo_weight=koleo_weight,
                         mask_ratio_stratified=mask_ratio_stratified,
                         gram_anchoring=gram_anchoring, optimizer=optimizer, betas=betas,
                         clip_grad=clip_grad, clip_grad_mode=clip_grad_mode,
                         momentum_base=momentum_base, momentum_schedule=momentum_schedule,
                         weight_decay=weight_decay, final_lr_ratio=final_lr_ratio,
                         freeze_last_layer_epochs=freeze_last_layer_epochs, **kwargs)
