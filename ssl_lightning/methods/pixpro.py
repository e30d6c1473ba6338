"""PixPro: Xie, Lin, Zhang, Cao, Lin & Hu, "Propagate Yourself: Exploring Pixel-Level Consistency
for Unsupervised Visual Representation Learning", CVPR 2021.

Two views of an image; an online encoder (backbone and a projection MLP applied to every
location of its feature map, the paper's 1x1-convolution head) and its momentum (EMA) copy. The
online projections of each view go through the pixel propagation module
(:class:`~ssl_lightning.heads.pixel_propagation.PixelPropagation`), and the propagated feature of
every location is pulled to the momentum encoder's projection of each location of the other view
closer than T = 0.7 bins in the original image (:func:`~ssl_lightning.losses.dense_matching.
position_pairs` on the crop boxes of :class:`~ssl_lightning.data.located_views.LocatedViews`: the
batch's views are ``[view_1, view_2, box_1, box_2]``), in both directions
(:class:`~ssl_lightning.losses.PixProLoss`). An optional instance branch (``instance_weight`` >
0) adds BYOL's loss on the pooled outputs of a second projector and a predictor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.data.located_views import BOX_SIZE
from ssl_lightning.heads import build_mlp
from ssl_lightning.heads.pixel_propagation import PixelPropagation
from ssl_lightning.losses import PixProLoss
from ssl_lightning.losses.dense_matching import map_to_locations, position_pairs
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.ema import Schedule, momentum_teacher


def _per_location(head: nn.Module, locations: Tensor) -> Tensor:
    """``head`` on every location (B, N, C) (its BatchNorm over all locations of the batch)."""
    return head(locations.flatten(0, 1)).unflatten(0, locations.shape[:2])


@register_method(
    "pixpro", title="PixPro", configs=("pixpro.yaml",),
    paper=Paper("Propagate Yourself: Exploring Pixel-Level Consistency for Unsupervised Visual "
                "Representation Learning", 2021, "2011.10043"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_pixpro.py",
    small=lambda backbone, **kw: PixPro(backbone, **{
        "projection_hidden_dim": 16, "projection_dim": 8, "head_batch_norm": False,
        "instance_weight": 1.0, "require_boxes": False, "momentum_base": 0.9, **kw}),
)
class PixPro(MomentumMethod):
    """PixPro on two views and their crop boxes.

    Args:
        backbone: Feature extractor with a feature map (``forward_dense``).
        projection_hidden_dim: Hidden width of the projector (and of the instance branch's
            projector and predictor) (4096, the authors' ``MLP2d``).
        projection_dim: Output size of the projector (256).
        head_batch_norm: BatchNorm in the hidden layers of the heads (and of the transform g
            with ``transform_layers`` = 2), over all locations of the batch.
        gamma: γ, the sharpness of the propagation's similarity (2).
        transform_layers: Layers of the propagation's transform g (1; 0 or 2).
        threshold: T, the largest distance of a positive pair in bins of the coarser view (0.7).
        instance_weight: Weight of the instance branch (0: off, the authors' released recipes).
        require_boxes: Refuse a batch without crop boxes (True). False: such a batch pairs
            locations as if both views were the whole image (views of one image that share
            their crop, e.g. precomputed test views), which is wrong for random crops.
        momentum_base: Teacher momentum at step 0 (0.99), raised to ``momentum_end`` by a cosine.
        momentum_schedule: ``"cosine"`` (the authors' code) or ``"constant"``.
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    batch_coupled_loss = False  # a mean of per-sample terms
    views_used = None  # the two views and their two boxes
    criterion: PixProLoss

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        head_batch_norm: bool = True,
        gamma: float = 2.0,
        transform_layers: int = 1,
        threshold: float = 0.7,
        instance_weight: float = 0.0,
        require_boxes: bool = True,
        momentum_base: float = 0.99,
        momentum_schedule: Schedule = "cosine",
        **kwargs: Any,
    ) -> None:
        if threshold <= 0:
            raise ValueError(f"threshold (T, in bins) must be > 0, got {threshold}.")
        if instance_weight < 0:
            raise ValueError(f"instance_weight must be >= 0, got {instance_weight}.")
        if transform_layers not in (0, 1, 2):
            raise ValueError(f"transform_layers (of the propagation's g) must be 0, 1 or 2, got "
                             f"{transform_layers}.")
        if gamma <= 0:
            raise ValueError(f"gamma (the propagation's sharpness) must be > 0, got {gamma}.")
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.threshold = threshold
        self.instance_weight = instance_weight
        self.require_boxes = require_boxes
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        self.projector = build_mlp(channels, projection_hidden_dim, projection_dim,
                                   batch_norm=head_batch_norm)
        self.propagation = PixelPropagation(projection_dim, gamma, transform_layers,
                                            batch_norm=head_batch_norm)
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        if instance_weight > 0:
            self.instance_projector = build_mlp(channels, projection_hidden_dim, projection_dim,
                                                batch_norm=head_batch_norm)
            self.predictor = build_mlp(projection_dim, projection_hidden_dim, projection_dim,
                                       batch_norm=head_batch_norm)
            self.teacher_instance_projector = momentum_teacher(self.instance_projector)

    def build_criterion(self) -> PixProLoss:
        return PixProLoss(self.instance_weight)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        pairs = [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]
        if self.instance_weight > 0:
            pairs.append((self.instance_projector, self.teacher_instance_projector))
        return pairs

    def _boxes(self, views: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """The two views' crop boxes; without them (``require_boxes`` False), whole-view boxes."""
        if len(views) >= 4:
            if any(v.dim() != 2 or v.shape[1] != BOX_SIZE for v in views[2:4]):
                raise ValueError(
                    "PixPro takes two views followed by their crop boxes (train_transform: "
                    f"LocatedViews); got a third view of shape {tuple(views[2].shape)}. Use "
                    "LocatedViews.")
            return views[2], views[3]
        if self.require_boxes:
            raise ValueError(
                "PixPro pairs locations by their position in the original image and needs the "
                "crop boxes after the two views (train_transform: LocatedViews); the batch has "
                f"{len(views)} views and no boxes. Use LocatedViews.")
        height, width = views[0].shape[-2:]
        whole = torch.tensor([0.0, 0.0, height, width, 0.0], device=views[0].device)
        return (whole.expand(len(views[0]), BOX_SIZE),) * 2

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        boxes = self._boxes(views)
        outputs: dict[str, Any] = {}
        for v in (0, 1):
            feature_map, pooled = dense_features(self.backbone, views[v])
            if v == 0:
                outputs["features"] = pooled
                height, width = feature_map.shape[2:]
                outputs["positives"] = position_pairs(boxes[0], boxes[1], height, width,
                                                      self.threshold)
            locations = map_to_locations(feature_map)
            outputs[f"propagated{v + 1}"] = self.propagation(
                _per_location(self.projector, locations))
            with torch.no_grad():
                teacher = map_to_locations(dense_features(self.teacher_backbone, views[v])[0])
                outputs[f"target{v + 1}"] = _per_location(self.teacher_projector, teacher)
                if self.instance_weight > 0:
                    outputs[f"instance_target{v + 1}"] = _per_location(
                        self.teacher_instance_projector, teacher).mean(dim=1)
            if self.instance_weight > 0:
                projected = _per_location(self.instance_projector, locations)
                outputs[f"instance_prediction{v + 1}"] = _per_location(
                    self.predictor, projected).mean(dim=1)
        return outputs

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        pixel = self.criterion.pixel(outputs["propagated1"], outputs["propagated2"],
                                     outputs["target1"], outputs["target2"],
                                     outputs["positives"])
        if self.instance_weight == 0:
            return pixel
        instance = self.criterion.instance(
            outputs["instance_prediction1"], outputs["instance_prediction2"],
            outputs["instance_target1"], outputs["instance_target2"])
        self.log_terms("pixpro", (("pixel", pixel), ("instance", instance)),
                       outputs["propagated1"].shape[0])
        return pixel + self.instance_weight * instance
