"""DetCon-B: Hénaff, Koppula, Alayrac, van den Oord, Vinyals & Carreira, "Efficient Visual
Pretraining with Contrastive Detection", ICCV 2021 (the BYOL form).

As :class:`~ssl_lightning.methods.detcon_s.DetConS` (the same segment masks and mask pooling), with
BYOL's networks: the online network (backbone, projector, predictor) predicts, per segment, the
momentum teacher's projections (EMA of backbone and projector), and the contrastive loss
(:class:`~ssl_lightning.losses.DetConLoss`) takes the online predictions as anchors and the
teacher's projections of the global batch as positives and negatives, in both directions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.dense import dense_channels
from ssl_lightning.heads import build_mlp
from ssl_lightning.losses import DetConLoss
from ssl_lightning.methods.detcon_s import (
    check_mask_settings,
    check_mask_transform,
    mask_uniforms,
    pooled_segments,
)
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.ema import Schedule, momentum_teacher


@register_method(
    "detcon_b", title="DetCon-B", configs=("detcon_b.yaml",),
    paper=Paper("Efficient Visual Pretraining with Contrastive Detection", 2021, "2103.10957"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_detcon_b.py",
    small=lambda backbone, **kw: DetConB(backbone, **{
        "projection_hidden_dim": 16, "projection_dim": 8, "head_batch_norm": False, "grid": 2,
        "momentum_base": 0.9, **kw}),
)
class DetConB(MomentumMethod):
    """DetCon-B on two views.

    Args:
        backbone: Feature extractor with a feature map (``forward_dense``).
        projection_hidden_dim: Hidden width of projector and predictor (4096 in the paper).
        projection_dim: Output size of projector and predictor (256).
        head_batch_norm: BatchNorm in the hidden layer of projector and predictor.
        temperature: τ (0.1).
        grid: Cells per side of the grid masks (4: 16 segments).
        segment_image_size: Side in pixels of the images the crop boxes refer to.
        num_segments: Segments read from dataset-provided segment maps.
        sampled_masks: 0: the masks above; M > 0: M masks sampled per view among the segments
            present in it (Felzenszwalb maps; the paper's 16), the same for student and teacher.
        momentum_base: Teacher momentum at step 0 (0.996), raised to 1 by a cosine.
        momentum_schedule: ``"cosine"`` (paper) or ``"constant"``.
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    views_used = None  # the two views and, optionally, their boxes or segment maps

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        head_batch_norm: bool = True,
        temperature: float = 0.1,
        grid: int = 4,
        segment_image_size: int = 32,
        num_segments: int = 16,
        momentum_base: float = 0.996,
        momentum_schedule: Schedule = "cosine",
        sampled_masks: int = 0,
        **kwargs: Any,
    ) -> None:
        check_mask_settings(grid, segment_image_size, num_segments, sampled_masks)
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.temperature, self.grid = temperature, grid
        self.segment_image_size, self.num_segments = segment_image_size, num_segments
        self.sampled_masks = sampled_masks
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        self.projector = build_mlp(channels, projection_hidden_dim, projection_dim,
                                   batch_norm=head_batch_norm)
        self.predictor = build_mlp(projection_dim, projection_hidden_dim, projection_dim,
                                   batch_norm=head_batch_norm)
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)

    def segments(self, backbone: nn.Module, views: Sequence[Tensor], view: int,
                 uniforms: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """See :func:`~ssl_lightning.methods.detcon_s.pooled_segments`."""
        return pooled_segments(backbone, views, view, self.grid, self.segment_image_size,
                               self.num_segments, uniforms)

    def build_criterion(self) -> DetConLoss:
        return DetConLoss(self.temperature)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        check_mask_transform(self, self.sampled_masks)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        outputs: dict[str, Any] = {}
        for v in (0, 1):
            # one draw per view: the student and the teacher pool the same sampled masks
            uniforms = mask_uniforms(self, views[0].shape[0], v, self.sampled_masks)
            segment_features, ids, pooled = self.segments(self.backbone, views, v, uniforms)
            if v == 0:
                outputs["features"] = pooled
            outputs[f"p{v + 1}"] = self.predictor(self.projector(
                segment_features.flatten(0, 1))).unflatten(0, ids.shape)
            outputs[f"ids{v + 1}"] = ids
            with torch.no_grad():
                teacher_features, _, _ = self.segments(self.teacher_backbone, views, v,
                                                        uniforms)
                outputs[f"z{v + 1}"] = self.teacher_projector(
                    teacher_features.flatten(0, 1)).unflatten(0, ids.shape)
        return outputs

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        p1, p2, ids1, ids2 = outputs["p1"], outputs["p2"], outputs["ids1"], outputs["ids2"]
        return self.criterion(p1, p2, self.gather_no_grad(outputs["z1"]),
                              self.gather_no_grad(outputs["z2"]), ids1, ids2,
                              self.gather_no_grad(ids1), self.gather_no_grad(ids2),
                              self.rank_offset(p1.shape[0]))
