"""DINOv2: Oquab et al., "DINOv2: Learning Robust Visual Features without Supervision", TMLR 2024.

The DINOv2 recipe (§4) assembled from our parts: :class:`~ssl_lightning.methods.ibot.IBOT`'s
[CLS] (DINO) and masked-patch losses with *separate* heads, Sinkhorn-Knopp centring of the
teacher outputs (or the EMA centres: ``centering="center"``), multi-crop with the local crops
required, teacher temperature warm-up, frozen last layer, cosine weight-decay schedule (DINO's
``weight_decay`` → ``weight_decay_end``), and the KoLeo regulariser on the student's
L2-normalised [CLS] backbone features of each global crop (weight 0.1). Register tokens (Darcet
et al., "Vision Transformers Need Registers", ICLR 2024) come from the backbone:
``ViT(num_registers=4)``.

KoLeo's nearest neighbours are searched over the batch gathered from all ranks (``koleo_scope=
"global"``: N processes equal one process with the global batch); ``"local"`` searches each
rank's own batch like the official code, which makes the loss depend on the number of GPUs.

:class:`DINOv2` is a preset of :class:`~ssl_lightning.methods.DINO`: the terms and their arguments
are documented there.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.losses.centering import Centering
from ssl_lightning.methods.dino import DINO
from ssl_lightning.methods.registry import SMALL_DINO_ARGS, Paper, register_method, small_vit
from ssl_lightning.training.dino_arguments import require_local_crops


@register_method(
    "dinov2", title="DINOv2", configs=("dinov2.yaml",),
    paper=Paper("DINOv2: Learning Robust Visual Features without Supervision", 2024, "2304.07193"),
    family="distillation", views=(8, 8, 4), tests="tests/methods/test_dinov2.py",
    docs="docs/ibot_dinov2.md",
    backbone=lambda: small_vit(mask_token=True, num_registers=1),
    cli_args={
        "dinov2.yaml": SMALL_DINO_ARGS,
    },
    small=lambda backbone, **kw: DINOv2(backbone, head_out_dim=12, head_hidden_dim=16,
                                        head_bottleneck_dim=8, momentum_base=0.9,
                                        warmup_teacher_temperature_epochs=0, shared_head=False,
                                        patch_out_dim=12, num_local_crops=1, image_size=8, **kw),
    position_keyed=True,
)
class DINOv2(DINO):
    """DINOv2 self-distillation: DINO + iBOT losses, Sinkhorn centring, KoLeo (a preset of
    :class:`DINO`).

    Args:
        backbone: A ViT with ``mask_token=True`` (optionally ``num_registers``).
        head_out_dim: Prototypes of the [CLS] head (65536 in DINOv2).
        patch_distillation: iBOT's masked-patch loss (on).
        shared_head: False (DINOv2's separate iBOT head); True shares the [CLS] head.
        centering: ``"sinkhorn"`` (DINOv2) or ``"center"`` (EMA centres).
        koleo_weight: Weight of the KoLeo term (0.1); 0 disables it.
        num_local_crops: Local crops the data must provide (8 in DINOv2); None: any number.
        mask_ratio_stratified: True (DINOv2's stratified mask ratios over the global batch,
            see :class:`DINO`).
        momentum_base: Teacher EMA momentum at step 0 (0.992 in DINOv2), cosine to 1.
        **kwargs: Other arguments of :class:`DINO`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 65536,
        patch_distillation: bool = True,
        shared_head: bool = False,
        centering: Centering = "sinkhorn",
        koleo_weight: float = 0.1,
        num_local_crops: int | None = 8,
        mask_ratio_stratified: bool = True,
        momentum_base: float = 0.992,
        **kwargs: Any,
    ) -> None:
        require_local_crops(type(self).__name__, num_local_crops)
        super().__init__(backbone, head_out_dim=head_out_dim,
                         patch_distillation=patch_distillation, shared_head=shared_head,
                         centering=centering, koleo_weight=koleo_weight,
                         num_local_crops=num_local_crops,
                         mask_ratio_stratified=mask_ratio_stratified,
                         momentum_base=momentum_base, **kwargs)
