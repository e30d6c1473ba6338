"""All4One: Estepa et al., "All4One: Symbiotic Neighbour Contrastive Learning via Self-Attention
and Redundancy Reduction", ICCV 2023 (and solo-learn's ``all4one``).

A student (backbone, 3-layer projection MLP, two prediction MLPs), its EMA teacher (backbone and
projector) and a support set of normalised teacher projections of view 1. Three terms
(:class:`~ssl_lightning.losses.All4OneLoss`): NNCLR's neighbour term (the nearest neighbour of
one view's teacher projection against the other view's predictions); the centroid term, where a
small transformer (:class:`~ssl_lightning.heads.NeighbourTransformer`) summarises the top-k
neighbours and a "shifted" sequence that starts with the sample's own second prediction; and a
feature-wise redundancy term on the cross-correlation of teacher and student projections over
the global batch. The neighbour lookups and the transformer run in
:meth:`All4One.loss_from_outputs`, after the networks and before the support set changes (a
lookup inside ``forward_views`` would read the updated support set in gradient caching's second
pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.distributed import all_reduce_sum_with_grad
from ssl_lightning.heads import NeighbourTransformer, PredictionHead
from ssl_lightning.losses import All4OneLoss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import NearestNeighbourSupport
from ssl_lightning.training.ema import Schedule, momentum_teacher


@register_method(
    "all4one", title="All4One", configs=("all4one.yaml",),
    paper=Paper("All4One: Symbiotic Neighbour Contrastive Learning "
                "via Self-Attention and Redundancy Reduction",
                2023, "2303.09417"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_all4one.py",
    cli_args={
        "all4one.yaml": (*SMALL_CONVNET_ARGS,
                         "--model.init_args.projection_hidden_dim", "64",
                         "--model.init_args.projection_dim", "64",
                         "--model.init_args.queue_size", "256"),
    },
    small=lambda backbone, **kw: All4One(backbone, projection_hidden_dim=16, projection_dim=8,
                                         head_batch_norm=False, predictor_hidden_dim=8,
                                         queue_size=16, neighbours=3, transformer_layers=1,
                                         transformer_heads=2, momentum_base=0.9, **kw),
)
class All4One(MomentumMethod):
    """All4One.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projection MLP (solo-learn CIFAR: 2048).
        projection_dim: Embedding size (256).
        projection_layers: Linear layers of the projection MLP (3).
        predictor_hidden_dim: Hidden width of both prediction MLPs (4096).
        head_batch_norm: BatchNorm in the MLPs (and an affine-free one on the projection); off
            for BatchNorm-free DDP tests.
        queue_size: Size of the support set (98,304); a multiple of the global batch.
        neighbours: k, the neighbours the transformer reads (5); >= 2.
        temperature: T of the neighbour term (0.2).
        centroid_temperature: T of the centroid term (0.1).
        neighbour_weight: Weight of the neighbour term (0.5).
        centroid_weight: Weight of the centroid term (0.5).
        feature_weight: Weight of the feature term (0.5 × 10).
        transformer_layers: Encoder layers of the neighbour transformer (3).
        transformer_heads: Its attention heads (8); must divide ``projection_dim``.
        transformer_dropout: Its dropout (solo-learn 0.1; 0 by default, see
            :class:`~ssl_lightning.heads.NeighbourTransformer`).
        loss_chunk_size: Anchor rows per block of the chunked loss; ``None``: dense logits.
        momentum_base: Teacher momentum at the first step (0.99).
        momentum_schedule: ``"cosine"`` towards ``momentum_end`` or ``"constant"``.
        projector: A projection head instead of the MLP (features -> ``projection_dim``).
        predictor: A prediction head instead of the first prediction MLP.
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = "the feature term normalises every dimension over the batch"

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 256,
        projection_layers: int = 3,
        predictor_hidden_dim: int = 4096,
        head_batch_norm: bool = True,
        queue_size: int = 98304,
        neighbours: int = 5,
        temperature: float = 0.2,
        centroid_temperature: float = 0.1,
        neighbour_weight: float = 0.5,
        centroid_weight: float = 0.5,
        feature_weight: float = 5.0,
        transformer_layers: int = 3,
        transformer_heads: int = 8,
        transformer_dropout: float = 0.0,
        loss_chunk_size: int | None = 1024,
        momentum_base: float = 0.99,
        momentum_schedule: Schedule = "cosine",
        projector: nn.Module | None = None,
        predictor: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if not 2 <= neighbours <= queue_size:
            raise ValueError(f"All4One neighbours must be in [2, queue_size={queue_size}] (the "
                             f"shifted sequence is the sample plus k - 1 neighbours), got "
                             f"{neighbours}.")
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.projector = self.build_mlp_projector(projector, projection_hidden_dim, projection_dim,
                                                  projection_layers, head_batch_norm,
                                                  last_batch_norm=head_batch_norm)
        self.predictor = self.build_head("predictor", predictor, lambda: PredictionHead(
            projection_dim, predictor_hidden_dim, projection_dim, batch_norm=head_batch_norm,
        ), projection_dim, projection_dim, "projection_dim")
        self.shift_predictor = PredictionHead(projection_dim, predictor_hidden_dim,
                                              projection_dim, batch_norm=head_batch_norm)
        self.transformer = NeighbourTransformer(projection_dim, neighbours, transformer_layers,
                                                transformer_heads, dropout=transformer_dropout)
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        self.support_set = NearestNeighbourSupport(queue_size, projection_dim)
        self.neighbours, self.loss_chunk_size = neighbours, loss_chunk_size
        self.temperature, self.centroid_temperature = temperature, centroid_temperature
        self.loss_weights = (neighbour_weight, centroid_weight, feature_weight)

    def build_criterion(self) -> nn.Module:
        return All4OneLoss(self.temperature, self.centroid_temperature, *self.loss_weights,
                           self.loss_chunk_size)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        batch = views[0].shape[0]
        images = torch.cat([views[0], views[1]])
        features = self.backbone(images)
        z = self.projector(features)
        with torch.no_grad():
            teacher = F.normalize(self.teacher_projector(self.teacher_backbone(images)), dim=1)
        outputs = {"z": z, "p": self.predictor(z), "q": self.shift_predictor(z), "t": teacher}
        split = {f"{name}{view + 1}": part for name, value in outputs.items()
                 for view, part in enumerate(value.chunk(2))}
        return {**split, "features": features[:batch]}

    def centroids(self, teacher: Tensor, shift: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The nearest neighbour of every teacher projection (B, D), the transformer's summary
        of its top-k neighbours and that of the shifted sequence ``[shift, NN_1..NN_{k-1}]``."""
        k = self.neighbours
        top = self.support_set.top_k(teacher, k)  # (B, k, D), no gradient
        shifted = torch.cat([shift[:, None], top[:, : k - 1].to(shift.dtype)], dim=1)
        return top[:, 0], self.transformer(top.to(shift.dtype)), self.transformer(shifted)

    def reduce_sum(self, x: Tensor) -> Tensor:
        """The feature term's sum over ranks (autograd-aware)."""
        return all_reduce_sum_with_grad(x)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        o = outputs
        nn1, c1, s1 = self.centroids(o["t1"], o["q1"])
        nn2, c2, s2 = self.centroids(o["t2"], o["q2"])
        loss = self.criterion(
            (nn1, nn2), (self.gather(o["p1"]), self.gather(o["p2"])), (c1, c2),
            (self.gather(s1), self.gather(s2)), (o["t1"], o["t2"]), (o["z1"], o["z2"]),
            self.rank_offset(o["z1"].shape[0]), self.reduce_sum)
        self.support_set.add(self.gather_no_grad(o["t1"]))
        return loss
