"""Barlow Twins: Zbontar et al., "Barlow Twins: Self-Supervised Learning via Redundancy
Reduction", ICML 2021. Two views, a projector MLP, and the cross-correlation of the
batch-normalised embeddings over the global batch driven to the identity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.distributed import all_reduce_sum_with_grad
from ssl_lightning.losses import BarlowTwinsLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method


@register_method(
    "barlow_twins", title="Barlow Twins", configs=("barlow_twins.yaml",),
    paper=Paper("Barlow Twins: Self-Supervised Learning via Redundancy Reduction",
                2021, "2103.03230"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_barlow_twins.py",
    small=lambda backbone, **kw: BarlowTwins(backbone, projection_hidden_dim=16,
                                             projection_dim=16, head_batch_norm=False, **kw),
)
class BarlowTwins(SSLMethod):
    """Barlow Twins.

    Each view goes through the backbone and projector separately (BatchNorm statistics per
    view, as in the official code). The batch normalisation of the embeddings and the
    cross-correlation use sums over all ranks through an autograd-aware all-reduce.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (8192 in the paper; 2048 for CIFAR).
        projection_dim: Output size D of the projector (8192 in the paper; 2048 for CIFAR).
        projection_layers: Linear layers of the projector (3 in the paper).
        head_batch_norm: BatchNorm after each hidden Linear. Turn off for BatchNorm-free
            models (exact-DDP tests), since BatchNorm statistics are per rank.
        lambda_offdiag: λ, weight of the redundancy-reduction term (5.1e-3 in the paper);
            ``None`` uses 1/D.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        projection_batch_norm: Deprecated name of ``head_batch_norm``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "the cross-correlation standardises every dimension over the global batch, undefined "
        "for one sample"
    )

    renamed_arguments = {"projection_batch_norm": "head_batch_norm"}

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 2048,
        projection_layers: int = 3,
        head_batch_norm: bool = True,
        lambda_offdiag: float | None = 0.0051,
        projector: nn.Module | None = None,
        *,
        projection_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "projection_batch_norm", projection_batch_norm,
                                           head_batch_norm)
        super().__init__(backbone, **kwargs)
        self.projector = self.build_mlp_projector(
            projector, projection_hidden_dim, projection_dim, projection_layers, head_batch_norm,
            last_bias=False)
        self.lambda_offdiag = lambda_offdiag

    def build_criterion(self) -> nn.Module:
        return BarlowTwinsLoss(self.lambda_offdiag)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        features = self.backbone(views[0])
        return {"z1": self.projector(features), "z2": self.projector(self.backbone(views[1])),
                "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["z1"], outputs["z2"], all_reduce_sum_with_grad)
