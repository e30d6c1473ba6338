"""iBOT: Zhou et al., "iBOT: Image BERT Pre-Training with Online Tokenizer", ICLR 2022.

DINO (:class:`~ssl_lightning.methods.dino.DINO`: multi-crop, EMA teacher, teacher temperature
warm-up, frozen last layer, clipping, weight-decay schedule) plus masked image modelling: the
student sees its two global crops with blockwise-masked patches replaced by the ViT's learned
mask token and, at every masked position, predicts the teacher's patch distribution of the
unmasked crop (:class:`~ssl_lightning.losses.IBOTPatchLoss`, own centre and temperatures). The
[CLS] loss is DINO's over all crop pairs, with the student's [CLS] of the masked global crops
(§3.3). Patch tokens go through the [CLS] head (``shared_head``, iBOT's ViT-S/B recipe) or a
separate head. Total loss: ``L_cls + patch_loss_weight · L_patch`` (λ = 1).

:class:`IBOT` is a preset of :class:`~ssl_lightning.methods.DINO` (``patch_distillation=True``):
the terms and their arguments are documented there.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.methods.dino import DINO
from ssl_lightning.methods.registry import SMALL_DINO_ARGS, Paper, register_method, small_vit


@register_method(
    "ibot", title="iBOT", configs=("ibot.yaml", "ibot_plus_plus.yaml"),
    paper=Paper("iBOT: Image BERT Pre-Training with Online Tokenizer", 2022, "2111.07832"),
    family="distillation", views=(8, 8, 4), tests="tests/methods/test_ibot.py",
    docs="docs/ibot_dinov2.md",
    backbone=lambda: small_vit(mask_token=True),
    cli_args={
        "ibot.yaml": SMALL_DINO_ARGS,
        "ibot_plus_plus.yaml": SMALL_DINO_ARGS,
    },
    small=lambda backbone, **kw: IBOT(backbone, head_out_dim=12, head_hidden_dim=16,
                                      head_bottleneck_dim=8, momentum_base=0.9,
                                      warmup_teacher_temperature_epochs=0, shared_head=False,
                                      patch_out_dim=12, num_local_crops=1, image_size=8, **kw),
)
class IBOT(DINO):
    """iBOT self-distillation on [CLS] and masked patch tokens: :class:`DINO` with
    ``patch_distillation`` on.

    The backbone must be a :class:`~ssl_lightning.backbones.ViT` built with ``mask_token=True``.

    Args:
        backbone: A ViT with ``forward_tokens`` and a mask token.
        head_out_dim: Prototypes K of the [CLS] head (8192 in iBOT).
        patch_distillation: The masked-patch loss (on: iBOT).
        **kwargs: Other arguments of :class:`DINO` (head widths, temperatures, masking,
            schedules, ...).
    """

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 8192,
        patch_distillation: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, head_out_dim=head_out_dim,
                         patch_distillation=patch_distillation, **kwargs)
