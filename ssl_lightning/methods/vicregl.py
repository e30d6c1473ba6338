"""VICRegL: Bardes, Ponce & LeCun, "VICRegL: Self-Supervised Learning of Local Visual Features",
NeurIPS 2022.

VICReg on the pooled features (an expander MLP) and on the feature map's locations (a second
MLP applied to every location), the locations of two views paired by the L2 distance of their
local embeddings and by their positions in the original image
(:class:`~ssl_lightning.losses.VICRegLLoss`). The positions come from the crop boxes that
:class:`~ssl_lightning.data.located_views.LocatedViews` appends to the views: the batch's views
are ``[view_1, view_2, box_1, box_2]``. Every term is a statistic of the global batch: the
embeddings, local embeddings and positions are gathered from all ranks (with gradients) and
every rank computes the same loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.data.located_views import BOX_SIZE, map_positions
from ssl_lightning.heads import build_mlp
from ssl_lightning.losses import VICRegLLoss
from ssl_lightning.losses.dense_matching import map_to_locations
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method


@register_method(
    "vicregl", title="VICRegL", configs=("vicregl.yaml",),
    paper=Paper("VICRegL: Self-Supervised Learning of Local Visual Features", 2022,
                "2210.01571"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_vicregl.py",
    small=lambda backbone, **kw: VICRegL(backbone, **{
        "expander_hidden_dim": 16, "expander_dim": 16, "local_hidden_dim": 8, "local_dim": 8,
        "head_batch_norm": False, "num_matches": (3, 2), "position_matching": False, **kw}),
)
class VICRegL(SSLMethod):
    """VICRegL on two views.

    Args:
        backbone: Feature extractor with a feature map (``forward_dense``).
        expander_hidden_dim: Hidden width of the global expander (8192 in the paper).
        expander_dim: Global embedding size (8192).
        expander_layers: Linear layers of both MLPs (3).
        local_hidden_dim: Hidden width of the local MLP (512, the authors' ``maps_mlp``).
        local_dim: Local embedding size (512).
        head_batch_norm: BatchNorm after each hidden Linear of both MLPs (the authors' code
            has it; off for BatchNorm-free models).
        invariance_weight: λ (25).
        variance_weight: μ (25).
        covariance_weight: ν (1; the local terms use ν/2).
        alpha: α, the global term's weight; the local one gets 1 − α (0.75 for ResNet-50).
        num_matches: Matched pairs kept from view a to b and from b to a (20, 4).
        position_matching: Also pair locations by position in the original image, which needs
            the crop boxes of :class:`~ssl_lightning.data.located_views.LocatedViews` in the
            batch; False: matching by feature distance alone.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "the variance and covariance terms are statistics over the global batch, undefined for "
        "one sample"
    )
    views_used = None  # the two views and, with position matching, their two boxes

    def __init__(
        self,
        backbone: nn.Module,
        expander_hidden_dim: int = 8192,
        expander_dim: int = 8192,
        expander_layers: int = 3,
        local_hidden_dim: int = 512,
        local_dim: int = 512,
        head_batch_norm: bool = True,
        invariance_weight: float = 25.0,
        variance_weight: float = 25.0,
        covariance_weight: float = 1.0,
        alpha: float = 0.75,
        num_matches: tuple[int, int] = (20, 4),
        position_matching: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        self.weights = (invariance_weight, variance_weight, covariance_weight)
        self.alpha = alpha
        self.num_matches = tuple(num_matches)
        self.position_matching = position_matching
        self.expander = build_mlp(self.feature_dim, expander_hidden_dim, expander_dim,
                                  expander_layers, batch_norm=head_batch_norm, last_bias=False)
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        self.local_expander = build_mlp(channels, local_hidden_dim, local_dim, expander_layers,
                                        batch_norm=head_batch_norm, last_bias=False)

    def build_criterion(self) -> VICRegLLoss:
        return VICRegLLoss(*self.weights, alpha=self.alpha,
                           num_matches=self.num_matches)  # type: ignore[arg-type]

    def _local(self, feature_map: Tensor) -> Tensor:
        locations = map_to_locations(feature_map)
        return self.local_expander(locations.flatten(0, 1)).unflatten(0, locations.shape[:2])

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        count = 4 if self.position_matching else 2
        self.require_views(views, count)
        if self.position_matching and (views[2].dim() != 2 or views[2].shape[1] != BOX_SIZE):
            raise ValueError(
                "VICRegL with position_matching needs the crop boxes after the two views "
                "(train_transform: LocatedViews); got a third view of shape "
                f"{tuple(views[2].shape)}. Use LocatedViews, or position_matching: false.")
        outputs: dict[str, Any] = {}
        for v in (0, 1):
            feature_map, pooled = dense_features(self.backbone, views[v])
            if v == 0:
                outputs["features"] = pooled
            outputs[f"z{v + 1}"] = self.expander(pooled)
            outputs[f"local{v + 1}"] = self._local(feature_map)
            if self.position_matching:
                outputs[f"positions{v + 1}"] = map_positions(views[2 + v], *feature_map.shape[2:])
        return outputs

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        embeddings = [self.gather(outputs[f"z{v}"]) for v in (1, 2)]
        local = [self.gather(outputs[f"local{v}"]) for v in (1, 2)]
        positions = [self.gather_no_grad(outputs[f"positions{v}"]) for v in (1, 2)] \
            if self.position_matching else None
        return self.criterion(embeddings, local, positions)
