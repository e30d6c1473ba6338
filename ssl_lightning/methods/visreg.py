"""VISReg: Wu, Balestriero & Levine, "VISReg: Variance-Invariance-Sketching Regularization for
JEPA training", arXiv 2606.02572 (2026). LeJEPA's set-up (one network, no teacher, no predictor,
no stop-gradient, multi-crop views pulled to the centre of the global views) with SIGReg replaced
by decoupled scale, sliced-Wasserstein shape and centre terms on the global batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.losses.sigreg import sigreg_directions
from ssl_lightning.losses.visreg import TERMS, VISRegLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method

#: :meth:`~ssl_lightning.training.step_rng.SeededSteps.step_generator` stream of the directions.
SLICES_STREAM = 1


@register_method(
    "visreg", title="VISReg", configs=("visreg.yaml",),
    paper=Paper("VISReg: Variance-Invariance-Sketching Regularization for JEPA training", 2026,
                "2606.02572"),
    family="non-contrastive", views=MULTI_CROP, tests="tests/methods/test_visreg.py",
    small=lambda backbone, **kw: VISReg(backbone, projection_hidden_dim=16, projection_dim=8,
                                        head_batch_norm=False, num_slices=16, **kw),
)
class VISReg(SSLMethod):
    """VISReg.

    Training batches hold ``[global_1, ..., global_G, local_1, ...]`` views
    (:class:`~ssl_lightning.data.multicrop.MultiCropViews`); the backbone runs once per crop
    resolution and the projector on all crops together. The shape term's directions come from
    the step's shared seed (the run's ``rng_seed``, epoch and batch index), the same on every
    rank, and the regularisers see the global batch (embeddings gathered with gradients), so N
    processes give the loss and gradients of one process on the global batch.

    Args:
        backbone: Feature extractor (ViT or ResNet; see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (2048, LeJEPA's).
        projection_dim: Output size of the projector (64, LeJEPA's in lightly).
        projection_layers: Linear layers of the projector (3).
        head_batch_norm: BatchNorm after each hidden Linear (on, as LeJEPA's). Turn off for
            BatchNorm-free models (exact-DDP tests), since BatchNorm statistics are per rank.
        lambda_param: λ, weight of the regulariser; the invariance term gets 1 − λ (0.9 for
            ImageNet; the paper recommends 0.6 for small datasets).
        lambda_scale: Weight of the scale term (1).
        lambda_shape: Weight of the shape term (1).
        lambda_center: Weight of the centre term (1).
        num_global_views: G, the leading views whose mean is the invariance target (2).
        num_slices: Directions M of the shape term per step (4096, lightly).
        eps: Added to σ in the shape normalisation (1e-4).
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    views_used = None  # every multi-crop view
    min_global_batch = 2
    min_global_batch_reason = ("the scale, shape and centre terms are statistics of the global "
                               "batch's embeddings")

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 64,
        projection_layers: int = 3,
        head_batch_norm: bool = True,
        lambda_param: float = 0.9,
        lambda_scale: float = 1.0,
        lambda_shape: float = 1.0,
        lambda_center: float = 1.0,
        num_global_views: int = 2,
        num_slices: int = 4096,
        eps: float = 1e-4,
        projector: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if num_slices < 1:
            raise ValueError(f"VISReg num_slices must be >= 1, got {num_slices}.")
        VISRegLoss(lambda_param, num_global_views, lambda_scale, lambda_shape, lambda_center,
                   eps)  # checks the values before anything is built
        super().__init__(backbone, **kwargs)
        self.lambda_param, self.lambda_scale, self.lambda_shape = (lambda_param, lambda_scale,
                                                                   lambda_shape)
        self.lambda_center, self.eps = lambda_center, eps
        self.num_global_views, self.num_slices = num_global_views, num_slices
        self.projector = self.build_mlp_projector(
            projector, projection_hidden_dim, projection_dim, projection_layers, head_batch_norm)

    def build_criterion(self) -> VISRegLoss:
        return VISRegLoss(self.lambda_param, self.num_global_views, self.lambda_scale,
                          self.lambda_shape, self.lambda_center, self.eps)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        return self.project_views(views, max(2, self.num_global_views))

    def directions(self, dim: int, like: Tensor) -> Tensor:
        """This step's (dim, num_slices) unit directions, identical on every rank."""
        return sigreg_directions(dim, self.num_slices, self.step_generator(SLICES_STREAM),
                                 like.device, like.dtype)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z = outputs["z"]
        terms = self.criterion.terms(z, self.gather(z), self.directions(z.shape[-1], z))
        self.log_terms("visreg", zip(TERMS, terms, strict=True), z.shape[0])
        return self.criterion.combine(*terms)
