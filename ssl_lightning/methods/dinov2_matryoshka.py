"""DINOv2 with Franca's Matryoshka heads: Venkataramanan et al., "Franca: Nested Matryoshka
Clustering for Scalable Visual Representation Learning", arXiv 2507.14137 (2025).

Franca trains DINOv2's objective (DINO [CLS] + iBOT patch losses, Sinkhorn-Knopp, KoLeo) with
every head replaced by nested heads on prefixes of the backbone feature (D/16 … D, 5 levels),
each with its own projection, MLP and ``K·d/D`` prototypes, and each loss summed over the levels
(§3.1, the authors' ``MRLDINOHead``). :class:`DINOv2Matryoshka` is that preset of
:class:`~ssl_lightning.methods.DINO` (``matryoshka_levels=5``); Franca's other parts (CyclicMask,
RASA post-training) are not in it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.methods.dinov2 import DINOv2
from ssl_lightning.methods.registry import SMALL_DINO_ARGS, Paper, register_method, small_vit


@register_method(
    "dinov2_matryoshka", title="Franca's Matryoshka heads", configs=("dinov2_matryoshka.yaml",),
    paper=Paper("Franca: Nested Matryoshka Clustering for Scalable Visual Representation "
                "Learning", 2025, "2507.14137"),
    family="distillation", views=(8, 8, 4), tests="tests/methods/test_dinov2_matryoshka.py",
    backbone=lambda: small_vit(mask_token=True, num_registers=1),
    cli_args={"dinov2_matryoshka.yaml": SMALL_DINO_ARGS},
    small=lambda backbone, **kw: DINOv2Matryoshka(
        backbone, head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8, momentum_base=0.9,
        warmup_teacher_temperature_epochs=0, patch_out_dim=16, num_local_crops=1, image_size=8,
        matryoshka_levels=3, **kw),
    position_keyed=True,
)
class DINOv2Matryoshka(DINOv2):
    """DINOv2 with nested Matryoshka [CLS] and patch heads (a preset of :class:`DINO`).

    Args:
        backbone: A ViT with ``mask_token=True``; its width must be divisible by
            ``2^(matryoshka_levels - 1)``.
        matryoshka_levels: Nested levels L (5 in Franca: D/16, D/8, D/4, D/2, D).
        **kwargs: Other arguments of :class:`DINOv2` / :class:`DINO`.
    """

    def __init__(self, backbone: nn.Module, matryoshka_levels: int = 5, **kwargs: Any) -> None:
        super().__init__(backbone, matryoshka_levels=matryoshka_levels, **kwargs)
