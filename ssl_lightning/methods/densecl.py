"""DenseCL: Wang, Zhang, Shen, Kong & Li, "Dense Contrastive Learning for Self-Supervised Visual
Pre-Training", CVPR 2021.

MoCo v2 (:class:`~ssl_lightning.methods.moco_v2.MoCoV2`: query encoder, EMA key encoder,
shuffle-BN, a queue of global keys) with a second, dense head: a 1x1-convolution MLP (here the
same MLP applied to every location of the backbone's feature map, ``forward_dense``) whose
outputs are contrasted location by location. The positive of a query location is the key
view's dense output at the location whose key-encoder backbone feature is most similar to the
query's backbone feature (:mod:`ssl_lightning.losses.dense_matching`); the negatives are a second
queue holding the key view's dense outputs averaged over locations. The loss is
``(1 − λ)·L_global + λ·L_dense`` (:class:`~ssl_lightning.losses.DenseCLLoss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.heads import build_mlp
from ssl_lightning.losses import DenseCLLoss
from ssl_lightning.losses.dense_matching import map_to_locations
from ssl_lightning.methods.moco_v2 import MoCoV2
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import FeatureQueue
from ssl_lightning.training.ema import momentum_teacher


@register_method(
    "densecl", title="DenseCL", configs=("densecl.yaml",),
    paper=Paper("Dense Contrastive Learning for Self-Supervised Visual Pre-Training", 2021,
                "2011.09157"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_densecl.py",
    small=lambda backbone, **kw: DenseCL(backbone, projection_hidden_dim=16, projection_dim=8,
                                         queue_size=16, symmetric=True, momentum_base=0.9,
                                         **kw),
)
class DenseCL(MoCoV2):
    """DenseCL: MoCo v2 plus a dense contrastive term between the views' feature maps.

    Args:
        backbone: Feature extractor with a feature map (``forward_dense``, every backbone of
            :mod:`ssl_lightning.backbones`).
        projection_hidden_dim: Hidden width of the global and the dense MLP (2048).
        projection_dim: Embedding size of both heads (128).
        queue_size: Negatives of each of the two queues (65536 in DenseCL); a multiple of the
            global batch.
        temperature: τ of both InfoNCE terms (0.2).
        dense_weight: λ, the dense term's weight; the global term gets 1 − λ (0.5).
        symmetric: Also use the second view as the query (both terms averaged over the two
            directions); the queues still receive the second view's keys only (DenseCL: False).
        **kwargs: Other arguments of :class:`MoCoV2` (``shuffle_bn``, ``momentum_*``,
            ``projector``, ``head_batch_norm``) and :class:`SSLMethod`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        queue_size: int = 65536,
        temperature: float = 0.2,
        dense_weight: float = 0.5,
        symmetric: bool = False,
        **kwargs: Any,
    ) -> None:
        if not 0 <= dense_weight <= 1:
            raise ValueError(f"dense_weight (λ) must be in [0, 1], got {dense_weight}.")
        super().__init__(backbone, projection_hidden_dim=projection_hidden_dim,
                         projection_dim=projection_dim, queue_size=queue_size,
                         temperature=temperature, symmetric=symmetric, **kwargs)
        self.temperature = temperature
        self.dense_weight = dense_weight
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        self.dense_projector = build_mlp(channels, projection_hidden_dim, projection_dim,
                                         batch_norm=False)
        self.teacher_dense_projector = momentum_teacher(self.dense_projector)
        self.dense_queue = FeatureQueue(queue_size, projection_dim, seed=1)

    def build_criterion(self) -> DenseCLLoss:
        return DenseCLLoss(self.temperature, self.dense_weight)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [*super().ema_pairs(), (self.dense_projector, self.teacher_dense_projector)]

    def _queries(self, x: Tensor) -> dict[str, Tensor]:
        feature_map, pooled = dense_features(self.backbone, x)
        grid = map_to_locations(feature_map)
        return {"features": pooled, "query": self.projector(pooled),
                "query_dense": self.dense_projector(grid), "query_grid": grid}

    def _keys(self, x: Tensor) -> tuple[Tensor, ...]:
        """Teacher outputs of images ``x``: normalised global keys (B, D), normalised dense keys
        (B, N, D), backbone locations (B, N, C), and the normalised mean dense key (B, D) that
        the dense queue receives."""
        feature_map, pooled = dense_features(self.teacher_backbone, x)
        grid = map_to_locations(feature_map)
        dense = self.teacher_dense_projector(grid)
        return (F.normalize(self.teacher_projector(pooled), dim=1), F.normalize(dense, dim=2),
                grid, F.normalize(dense.mean(dim=1), dim=1))

    def _directions(self) -> list[tuple[int, int]]:
        return [(1, 2), (2, 1)] if self.symmetric else [(1, 2)]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        outputs: dict[str, Any] = {}
        for query_view, key_view in self._directions():
            queries = self._queries(views[query_view - 1])
            if query_view == 1:
                outputs["features"] = queries.pop("features")
            outputs.update({f"{name}{query_view}": value for name, value in queries.items()
                            if name != "features"})
            keys = self.shuffled_teacher(self._keys, views[key_view - 1])
            outputs.update({f"{name}{key_view}": value for name, value in zip(
                ("key", "key_dense", "key_grid", "key_mean_dense"), keys, strict=True)})
        return outputs

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        negatives, dense_negatives = self.queue.negatives(), self.dense_queue.negatives()
        terms = [self.criterion.terms(
            outputs[f"query{q}"], outputs[f"key{k}"], negatives, outputs[f"query_dense{q}"],
            outputs[f"key_dense{k}"], outputs[f"query_grid{q}"], outputs[f"key_grid{k}"],
            dense_negatives) for q, k in self._directions()]
        global_term = sum(t[0] for t in terms) / len(terms)
        dense_term = sum(t[1] for t in terms) / len(terms)
        self.log_terms("densecl", (("global", global_term), ("dense", dense_term)),
                       outputs["query1"].shape[0])
        self.queue.enqueue(self.gather_no_grad(outputs["key2"]))
        self.dense_queue.enqueue(self.gather_no_grad(outputs["key_mean_dense2"]))
        return self.criterion.combine(global_term, dense_term)
