"""MMCR: Yerxa et al., "Learning Efficient Coding of Natural Images with Maximum Manifold Capacity
Representations", NeurIPS 2023. k views per sample through one network (backbone + projector);
the nuclear norm of the matrix of per-sample view centroids over the global batch is maximised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.losses import MMCRLoss
from ssl_lightning.losses.mmcr import centroids
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import Paper, register_method


@register_method(
    "mmcr", title="MMCR", configs=("mmcr.yaml",),
    paper=Paper("Learning Efficient Coding of Natural "
                "Images with Maximum Manifold Capacity Representations",
                2023, "2303.03307"),
    family="non-contrastive", views=(8, 8, 8), tests="tests/methods/test_mmcr.py",
    small=lambda backbone, **kw: MMCR(backbone, projection_hidden_dim=16, projection_dim=8,
                                      head_batch_norm=False, **kw),
)
class MMCR(SSLMethod):
    """MMCR.

    Training batches hold k >= 2 views of every sample (e.g. ``SimCLRViews(num_views=k)``);
    the backbone runs once per view resolution, the projector on all views together. The
    centroid matrix is gathered from all ranks with gradients.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (512 in lightly's CIFAR example).
        projection_dim: Output size of the projector (128).
        projection_layers: Linear layers of the projector (2).
        head_batch_norm: BatchNorm after each hidden Linear. Turn off for BatchNorm-free
            models (exact-DDP tests), since BatchNorm statistics are per rank.
        lambda_views: λ, weight of the mean view-matrix nuclear norm (5e-3).
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    views_used = None  # all k views
    min_global_batch = 2
    min_global_batch_reason = "the centroid matrix's nuclear norm compares the samples"

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        projection_layers: int = 2,
        head_batch_norm: bool = True,
        lambda_views: float = 5e-3,
        projector: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        self.projector = self.build_mlp_projector(
            projector, projection_hidden_dim, projection_dim, projection_layers, head_batch_norm)
        self.lambda_views = lambda_views

    def build_criterion(self) -> MMCRLoss:
        return MMCRLoss(self.lambda_views)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        return self.project_views(views)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z = outputs["z"]
        return self.criterion(z, self.gather(centroids(z)))
