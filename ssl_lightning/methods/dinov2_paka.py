"""DINOv2 with PaKA: "Patch-Level Kernel Alignment for Dense Self-Supervised Learning", arXiv
2509.05606 (2025), as lightly-train's ``dinov31`` (DINOv2 + a PaKA term).

DINOv2's objective plus ``paka_weight`` × :class:`~ssl_lightning.losses.paka.PaKALoss`: the CKA of
the patch kernels of the student's (masked) global crops and of the teacher's unmasked crops,
both through a 3-layer projection MLP (D → 2048 → 2048 → 256, GELU; the teacher's is the EMA of
the student's). This is the same-view form of the loss (``paka_views: same``); lightly-train's
``dinov31`` pairs extra high-overlap student local crops with augmentation-free teacher globals,
ROI-aligned onto a common grid: that cross-crop form is ``paka_views: across`` with
``train_transform: PaKAViews`` (:meth:`~ssl_lightning.methods.DINO.forward_paka_across`).
:class:`DINOv2PaKA` is a preset of :class:`~ssl_lightning.methods.DINO` (``paka_weight=1``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.methods.dinov2 import DINOv2
from ssl_lightning.methods.registry import SMALL_DINO_ARGS, Paper, register_method, small_vit


@register_method(
    "dinov2_paka", title="PaKA", configs=("dinov2_paka.yaml",),
    paper=Paper("Patch-Level Kernel Alignment for Dense Self-Supervised Learning", 2025,
                "2509.05606"),
    family="distillation", views=(8, 8, 4), tests="tests/methods/test_dinov2_paka.py",
    backbone=lambda: small_vit(mask_token=True, num_registers=1),
    cli_args={
        "dinov2_paka.yaml": (*SMALL_DINO_ARGS, "--model.init_args.paka_hidden_dim", "32",
                             "--model.init_args.paka_dim", "16"),
    },
    small=lambda backbone, **kw: DINOv2PaKA(
        backbone, head_out_dim=12, head_hidden_dim=16, head_bottleneck_dim=8, momentum_base=0.9,
        warmup_teacher_temperature_epochs=0, patch_out_dim=12, num_local_crops=1, image_size=8,
        paka_hidden_dim=16, paka_dim=8, **kw),
    position_keyed=True,
)
class DINOv2PaKA(DINOv2):
    """DINOv2 plus PaKA's patch kernel alignment (a preset of :class:`DINO`).

    Args:
        backbone: A ViT with ``mask_token=True``.
        paka_weight: Weight of the PaKA term (1.0, lightly-train's ``paka_weight``).
        **kwargs: Other arguments of :class:`DINOv2` / :class:`DINO` (``paka_hidden_dim``,
            ``paka_dim``).
    """

    def __init__(self, backbone: nn.Module, paka_weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(backbone, paka_weight=paka_weight, **kwargs)
