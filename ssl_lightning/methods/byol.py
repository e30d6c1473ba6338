"""BYOL: Grill et al., "Bootstrap Your Own Latent: A New Approach to Self-Supervised Learning",
NeurIPS 2020.

Online network: backbone, projector and predictor; target network: the EMA of backbone and
projector (tau from 0.996 to 1 by a cosine per step, §3.2). The loss is the symmetrised
``2 − 2·cos(q, sg(z'))`` (Eq. 2). Every term is per sample, so under DDP nothing is gathered; the
heads' BatchNorm statistics are per rank unless ``--trainer.sync_batchnorm true`` (the paper
uses cross-replica BN on TPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.heads import PredictionHead, ProjectionHead
from ssl_lightning.losses import BYOLLoss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.ema import Schedule, momentum_teacher


@register_method(
    "byol", title="BYOL", configs=("byol.yaml",),
    paper=Paper("Bootstrap Your Own Latent: A New Approach to Self-Supervised Learning",
                2020, "2006.07733"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_byol.py",
    cli_args={
        "byol.yaml": ("--model.init_args.projection_hidden_dim", "64"),
    },
    small=lambda backbone, **kw: BYOL(backbone, projection_hidden_dim=16, projection_dim=8,
                                      head_batch_norm=False, momentum_base=0.9, **kw),
)
class BYOL(MomentumMethod):
    """BYOL.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of projector and predictor (4096 in the paper).
        projection_dim: Output size of projector and predictor (256).
        head_batch_norm: BatchNorm in the hidden layer of projector and predictor (paper:
            Linear-BN-ReLU-Linear). Turn off for BatchNorm-free models (exact-DDP tests).
        momentum_base: Target momentum at step 0 (0.996), raised to ``momentum_end`` by a cosine.
        momentum_schedule: ``"cosine"`` (paper) or ``"constant"``.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        predictor: A prediction head to use instead of the MLP above (any module mapping
            ``projection_dim`` to ``projection_dim``).
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    batch_coupled_loss = False  # a mean of per-sample terms

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        head_batch_norm: bool = True,
        momentum_base: float = 0.996,
        momentum_schedule: Schedule = "cosine",
        projector: nn.Module | None = None,
        predictor: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.predictor = self.build_head("predictor", predictor, lambda: PredictionHead(
            projection_dim, projection_hidden_dim, projection_dim, batch_norm=head_batch_norm,
        ), projection_dim, projection_dim, "projection_dim")
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        self.projection_dim = projection_dim

    def build_criterion(self) -> nn.Module:
        return BYOLLoss()

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        p1, p2, z1, z2, features = self.predict_both_views(views)
        return {"p1": p1, "p2": p2, "z1": z1, "z2": z2, "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["p1"], outputs["p2"], outputs["z1"], outputs["z2"])
