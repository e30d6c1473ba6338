"""TiCo: Zhu et al., "TiCo: Transformation Invariance and Covariance Contrast for Self-Supervised
Visual Representation Learning", arXiv 2206.10698 (2022). An online network (backbone +
projector) and its EMA copy, as BYOL without the predictor; the loss pulls the online embedding
of one view to the momentum embedding of the other and pushes it away from the directions a
running covariance of past embeddings already covers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import TiCoLoss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.ema import momentum_teacher


@register_method(
    "tico", title="TiCo", configs=("tico.yaml",),
    paper=Paper("TiCo: Transformation Invariance and Covariance "
                "Contrast for Self-Supervised Visual Representation Learning",
                2022, "2206.10698"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_tico.py",
    small=lambda backbone, **kw: TiCo(backbone, projection_hidden_dim=16, projection_dim=8,
                                      head_batch_norm=False, momentum_base=0.9, **kw),
)
class TiCo(MomentumMethod):
    """TiCo.

    View 1 goes through the online network, view 2 through the momentum network (Algorithm 1).
    The running covariance is the persistent buffer ``criterion.covariance``, updated once per
    step from the online embeddings gathered from all ranks.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (4096, as BYOL's).
        projection_dim: Output size D of the projector (256).
        head_batch_norm: BatchNorm in the projector's hidden layer. Turn off for BatchNorm-free
            models (exact-DDP tests).
        beta: β, momentum of the running covariance (0.9).
        rho: ρ, weight of the covariance-contrast term (8).
        momentum_base: Momentum-network EMA at step 0 (0.99), cosine to ``momentum_end``.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``).
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        head_batch_norm: bool = True,
        beta: float = 0.9,
        rho: float = 8.0,
        momentum_base: float = 0.99,
        projector: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, momentum_base=momentum_base, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        self.projection_dim, self.beta, self.rho = projection_dim, beta, rho

    def build_criterion(self) -> nn.Module:
        return TiCoLoss(self.projection_dim, self.beta, self.rho)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        features = self.backbone(views[0])
        with torch.no_grad():
            z_b = self.teacher_projector(self.teacher_backbone(views[1]))
        return {"z_a": self.projector(features), "z_b": z_b, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z_a = outputs["z_a"]
        return self.criterion(z_a, outputs["z_b"], self.gather_no_grad(z_a.detach()))
