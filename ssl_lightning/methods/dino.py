"""DINO: Caron et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV 2021.

Student (backbone + :class:`DINOHead`) sees all multi-crop views, the EMA teacher only the 2
global ones (Algorithm 1); :class:`DINOLoss` compares them with a centred, sharpened teacher.
The recipe details of the paper's code are arguments: teacher temperature warm-up (per epoch),
last layer frozen during the first epoch(s), per-parameter gradient clipping (or DINOv2's clip of
each module's gradient norm), teacher momentum 0.996 → 1 (cosine, through :class:`EMACallback`);
the cosine weight-decay schedule (0.04 → 0.4) is :class:`SSLMethod`'s ``weight_decay_end``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.backbones.rope import RotaryPositionEmbedding
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.heads import DINOHead
from ssl_lightning.losses import DINOLoss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method
from ssl_lightning.optim import epoch_linspace
from ssl_lightning.training.ema import momentum_teacher

ClipMode = Literal["per_parameter", "per_module"]


@register_method(
    "dino", title="DINO", configs=("dino.yaml",),
    paper=Paper("Emerging Properties in Self-Supervised Vision Transformers", 2021, "2104.14294"),
    family="distillation", views=MULTI_CROP, tests="tests/methods/test_dino.py",
    small=lambda backbone, **kw: DINO(backbone, head_out_dim=12, head_hidden_dim=16,
                                      head_bottleneck_dim=8, clip_grad=0.05, momentum_base=0.9,
                                      warmup_teacher_temperature_epochs=0, **kw),
)
class DINO(MomentumMethod):
    """DINO self-distillation with multi-crop.

    Training batches hold ``[global_1, global_2, local_1, ...]`` views
    (:class:`~ssl_lightning.data.multicrop.MultiCropViews`); the number of local crops V is set
    there.

    Args:
        backbone: Feature extractor (ViT or ResNet; see :class:`SSLMethod`).
        head_out_dim: Prototypes K (65536 on ImageNet; 4096 is plenty for CIFAR-10).
        head_hidden_dim: Hidden width of the head MLP (2048).
        head_bottleneck_dim: Bottleneck before the last layer (256).
        head_batch_norm: BatchNorm in the head MLP (off for ViTs, as in the paper).
        norm_last_layer: Fix the norm of the last-layer rows to 1 (paper default).
        student_temperature: τ_s (0.1).
        teacher_temperature: Final τ_t after the warm-up (0.04-0.07).
        warmup_teacher_temperature: τ_t at epoch 0 (0.04).
        warmup_teacher_temperature_epochs: Epochs of the linear τ_t warm-up (30 for ViT-S/300 ep):
            ``linspace(warm-up value, final, epochs)``, the final value reached in the last.
        center_momentum: Momentum of the centre EMA (0.9).
        freeze_last_layer_epochs: Epochs during which the head's last layer is not updated (1).
        clip_grad: Gradient-norm clip (3.0), or None for no clipping.
        clip_grad_mode: ``"per_parameter"``: each parameter's gradient norm (DINO's code);
            ``"per_module"``: the norm of all gradients of each trainable module (backbone,
            head, iBOT head) together (DINOv2's code).
        momentum_base: Teacher EMA momentum at step 0 (0.996), cosine to ``momentum_end`` (1).
        **kwargs: Other arguments of :class:`MomentumMethod` / :class:`SSLMethod`, e.g.
            ``weight_decay_end`` (the paper's 0.04 → 0.4 cosine schedule with AdamW).
    """

    views_used = None  # every multi-crop view

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 65536,
        head_hidden_dim: int = 2048,
        head_bottleneck_dim: int = 256,
        head_batch_norm: bool = False,
        norm_last_layer: bool = True,
        student_temperature: float = 0.1,
        teacher_temperature: float = 0.07,
        warmup_teacher_temperature: float = 0.04,
        warmup_teacher_temperature_epochs: int = 30,
        center_momentum: float = 0.9,
        freeze_last_layer_epochs: int = 1,
        clip_grad: float | None = 3.0,
        clip_grad_mode: ClipMode = "per_parameter",
        momentum_base: float = 0.996,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, momentum_base=momentum_base, **kwargs)
        for name, value in (("teacher_temperature", teacher_temperature),
                            ("warmup_teacher_temperature", warmup_teacher_temperature)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
        for name, value in (("warmup_teacher_temperature_epochs",
                             warmup_teacher_temperature_epochs),
                            ("freeze_last_layer_epochs", freeze_last_layer_epochs)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        if clip_grad is not None and not clip_grad > 0:
            raise ValueError(f"clip_grad must be > 0 or None, got {clip_grad}.")
        if clip_grad_mode not in ("per_parameter", "per_module"):
            raise ValueError(f"clip_grad_mode must be 'per_parameter' or 'per_module', got "
                             f"{clip_grad_mode!r}.")
        self.head = DINOHead(self.feature_dim, head_out_dim, head_hidden_dim, head_bottleneck_dim,
                             batch_norm=head_batch_norm, norm_last_layer=norm_last_layer)
        self.teacher_backbone = momentum_teacher(self.backbone)
        for module in self.teacher_backbone.modules():
            if isinstance(module, DropPath):  # the paper's teacher has no stochastic depth
                module.drop_prob = 0.0
            elif isinstance(module, RotaryPositionEmbedding):  # DINOv3: nor RoPE augmentation
                module.shift, module.jitter, module.rescale = 0.0, 1.0, 1.0
        self.teacher_head = momentum_teacher(self.head)
        self.criterion = self.build_criterion()

    def build_criterion(self) -> nn.Module:
        hp = self.hparams
        return DINOLoss(hp["head_out_dim"], hp["student_temperature"], hp["center_momentum"])

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.head, self.teacher_head)]

    def teacher_temperature(self, epoch: int) -> float:
        """τ_t of ``epoch``: the official per-epoch linear space from the warm-up value to the
        final one over ``warmup_teacher_temperature_epochs``, then constant."""
        hp = self.hparams
        return epoch_linspace(epoch, hp["warmup_teacher_temperature_epochs"],
                              hp["warmup_teacher_temperature"], hp["teacher_temperature"])

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        if len(views) < 2:
            raise ValueError(f"DINO needs 2 global views (+ local views), got {len(views)}.")
        batch = views[0].shape[0]
        with torch.no_grad():
            teacher_out = self.teacher_head(forward_by_resolution(self.teacher_backbone, views[:2]))
        features = forward_by_resolution(self.backbone, views)
        student_out = self.head(features)
        return {"student": list(student_out.chunk(len(views))),
                "teacher": list(teacher_out.chunk(2)), "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        temperature = self.teacher_temperature(self.current_epoch)
        loss = self.criterion(outputs["student"], outputs["teacher"], temperature)
        if self._trainer is not None:
            self.log("train/teacher_temperature", temperature, on_step=False, on_epoch=True)
        return loss

    # ------------------------------------------------------------- optimiser-step adjustments
    def adjust_gradients_(self, epoch: int) -> None:
        """Clip the gradients (``clip_grad_mode``), then drop the last layer's gradients while
        it is frozen."""
        clip = self.hparams["clip_grad"]
        if clip is not None and self.hparams["clip_grad_mode"] == "per_module":
            for module in self.trainable_modules():
                grads = [p for p in module.parameters() if p.requires_grad and p.grad is not None]
                if grads:
                    torch.nn.utils.clip_grad_norm_(grads, clip)
        elif clip is not None:
            for p in self.trainable_parameters():
                if p.grad is not None:
                    scale = clip / (torch.linalg.vector_norm(p.grad) + 1e-6)
                    p.grad.mul_(scale.clamp(max=1.0))
        if epoch < self.hparams["freeze_last_layer_epochs"]:
            for p in self.head.last_layer_parameters():
                p.grad = None  # skipped by the optimiser: no momentum, no weight decay

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.trainable_modules() for p in m.parameters() if p.requires_grad]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.adjust_gradients_(self.current_epoch)
        super().on_before_optimizer_step(optimizer)  # the weight-decay schedule
