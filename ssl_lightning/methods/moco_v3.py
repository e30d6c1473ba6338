"""MoCo v3: Chen, Xie & He, "An Empirical Study of Training Self-Supervised Vision Transformers",
ICCV 2021.

Query branch: backbone, projector and predictor; key branch: the momentum encoder (EMA of
backbone + projector, no predictor). The symmetric loss ``ctr(q1, k2) + ctr(q2, k1)`` contrasts
each query with the keys of the whole global batch, gathered from all ranks without gradient,
with labels offset by the rank (§3, Algorithm 1). No queue. Momentum follows a cosine schedule
from 0.99 to 1. The paper uses SyncBN in the heads under DDP (``--trainer.sync_batchnorm true``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.heads import PredictionHead, ProjectionHead
from ssl_lightning.losses import MoCoV3Loss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.ema import Schedule, momentum_teacher


@register_method(
    "moco_v3", title="MoCo v3", configs=("moco_v3.yaml", "moco_v3_vit.yaml"),
    paper=Paper("An Empirical Study of Training Self-Supervised Vision Transformers",
                2021, "2104.02057"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_moco_v3.py",
    cli_args={
        "moco_v3.yaml": ("--model.init_args.projection_hidden_dim", "64"),
        "moco_v3_vit.yaml": ("--model.init_args.projection_hidden_dim", "64",
                             "--model.init_args.backbone.init_args.depth", "2"),
    },
    small=lambda backbone, **kw: MoCoV3(backbone, projection_hidden_dim=16, projection_dim=8,
                                        projection_layers=2, head_batch_norm=False, **kw),
)
class MoCoV3(MomentumMethod):
    """MoCo v3.

    Args:
        backbone: Feature extractor (ResNet or ViT; see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of projector and predictor (4096 in the paper).
        projection_dim: Output size of projector and predictor (256).
        projection_layers: Linear layers of the projector (3 in the paper; 2 are enough for
            CIFAR ResNets).
        head_batch_norm: BatchNorm in projector and predictor, with an affine-free BN on their
            outputs as in the paper. Turn off for BatchNorm-free models (exact-DDP tests).
        temperature: Contrastive temperature (1.0 for ResNet, 0.2 for ViT in the paper).
        momentum_base: Momentum at step 0 (0.99), raised to ``momentum_end`` by a cosine.
        momentum_schedule: ``"cosine"`` (paper) or ``"constant"``.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        predictor: A prediction head to use instead of the MLP above (any module mapping
            ``projection_dim`` to ``projection_dim``).
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "the negatives of each query are the keys of the other samples of the global batch; "
        "with one sample the loss is exactly 0"
    )

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        projection_layers: int = 3,
        head_batch_norm: bool = True,
        temperature: float = 1.0,
        momentum_base: float = 0.99,
        momentum_schedule: Schedule = "cosine",
        projector: nn.Module | None = None,
        predictor: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, projection_layers,
            batch_norm=head_batch_norm, last_batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.predictor = self.build_head("predictor", predictor, lambda: PredictionHead(
            projection_dim, projection_hidden_dim, projection_dim, 2,
            batch_norm=head_batch_norm, last_batch_norm=head_batch_norm,
        ), projection_dim, projection_dim, "projection_dim")
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        self.temperature = temperature

    def build_criterion(self) -> nn.Module:
        return MoCoV3Loss(self.temperature)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        q1, q2, k1, k2, features = self.predict_both_views(views)
        return {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        k1, k2 = self.gather_no_grad(outputs["k1"]), self.gather_no_grad(outputs["k2"])
        offset = self.rank_offset(outputs["q1"].shape[0])
        return (self.criterion(outputs["q1"], k2, offset)
                + self.criterion(outputs["q2"], k1, offset))
