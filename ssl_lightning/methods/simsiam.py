"""SimSiam: Chen & He, "Exploring Simple Siamese Representation Learning", CVPR 2021.
Two views, a projector, a predictor, stop-gradient on the target branch and the symmetrised
negative cosine similarity. No negatives, no momentum encoder, no cross-rank statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import PredictionHead, ProjectionHead
from ssl_lightning.losses import NegativeCosineLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method


@register_method(
    "simsiam", title="SimSiam", configs=("simsiam.yaml",),
    paper=Paper("Exploring Simple Siamese Representation Learning", 2021, "2011.10566"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_simsiam.py",
    small=lambda backbone, **kw: SimSiam(backbone, projection_hidden_dim=16, projection_dim=16,
                                         predictor_hidden_dim=8, head_batch_norm=False, **kw),
)
class SimSiam(SSLMethod):
    """SimSiam.

    The projector is Linear-BN-ReLU blocks ending in Linear-BN (BN on the output, §3 of the
    paper); the predictor is a Linear-BN-ReLU-Linear bottleneck. With ``fixed_predictor_lr``
    the predictor keeps the (scaled) peak learning rate throughout, without warm-up or cosine
    decay, which the paper found slightly better (§4.2, Table 1c).

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (2048 in the paper).
        projection_dim: Output size of projector and predictor (2048 in the paper).
        projection_layers: Linear layers of the projector (3 for ImageNet, 2 for CIFAR).
        predictor_hidden_dim: Bottleneck width of the predictor (512 in the paper).
        head_batch_norm: BatchNorm in projector and predictor. Turn off for BatchNorm-free models
            (exact-DDP tests), since BatchNorm statistics are per rank.
        fixed_predictor_lr: Exclude the predictor from the lr schedule.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        predictor: A prediction head to use instead of the MLP above (any module mapping
            ``projection_dim`` to ``projection_dim``).
        batch_norm: Deprecated name of ``head_batch_norm``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    batch_coupled_loss = False  # a mean of per-sample terms

    renamed_arguments = {"batch_norm": "head_batch_norm"}

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 2048,
        projection_layers: int = 3,
        predictor_hidden_dim: int = 512,
        head_batch_norm: bool = True,
        fixed_predictor_lr: bool = True,
        projector: nn.Module | None = None,
        predictor: nn.Module | None = None,
        *,
        batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "batch_norm", batch_norm, head_batch_norm)
        super().__init__(backbone, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, projection_layers,
            batch_norm=head_batch_norm, last_batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.predictor = self.build_head("predictor", predictor, lambda: PredictionHead(
            projection_dim, predictor_hidden_dim, projection_dim, 2, batch_norm=head_batch_norm
        ), projection_dim, projection_dim, "projection_dim")
        self.fixed_predictor_lr = fixed_predictor_lr
        self.projection_dim = projection_dim

    def build_criterion(self) -> nn.Module:
        return NegativeCosineLoss()

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        features = self.backbone(views[0])
        z1, z2 = self.projector(features), self.projector(self.backbone(views[1]))
        return {"p1": self.predictor(z1), "p2": self.predictor(z2), "z1": z1, "z2": z2,
                "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["p1"], outputs["p2"], outputs["z1"], outputs["z2"])

    def param_groups(self) -> list[dict]:
        """The base groups, with the predictor in groups of its own marked ``fixed_lr``."""
        if not self.fixed_predictor_lr:
            return super().param_groups()
        others = [m for m in self.trainable_modules() if m is not self.predictor]
        predictor = self.decay_groups([self.predictor])
        return self.decay_groups(others) + [
            {**group, "fixed_lr": True} for group in predictor
        ]
