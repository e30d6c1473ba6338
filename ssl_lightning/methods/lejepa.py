"""LeJEPA: Balestriero & LeCun, "LeJEPA: Provable and Scalable Self-Supervised Learning Without
the Heuristics", arXiv 2511.08544 (2025). One network (no teacher, no predictor, no stop-gradient)
on multi-crop views; the projections of all views are pulled to the centre of the global views and
regularised towards an isotropic Gaussian by SIGReg, a statistic of the global batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.distributed import all_reduce_sum_with_grad
from ssl_lightning.losses import LeJEPALoss
from ssl_lightning.losses.sigreg import sigreg_directions
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method

#: :meth:`~ssl_lightning.training.step_rng.SeededSteps.step_generator` stream of the directions.
SIGREG_STREAM = 1


@register_method(
    "lejepa", title="LeJEPA", configs=("lejepa.yaml",),
    paper=Paper("LeJEPA: Provable and Scalable Self-Supervised Learning Without the Heuristics",
                2025, "2511.08544"),
    family="non-contrastive", views=MULTI_CROP, tests="tests/methods/test_lejepa.py",
    small=lambda backbone, **kw: LeJEPA(backbone, projection_hidden_dim=16, projection_dim=8,
                                        head_batch_norm=False, num_slices=16, **kw),
)
class LeJEPA(SSLMethod):
    """LeJEPA with SIGReg.

    Training batches hold ``[global_1, ..., global_G, local_1, ...]`` views
    (:class:`~ssl_lightning.data.multicrop.MultiCropViews`); the backbone runs once per crop
    resolution and the projector on all crops together. The SIGReg directions of a step come
    from the step's shared seed (:meth:`step_generator`: the run's ``rng_seed``, epoch and
    batch index), the same on every rank, and its sums are all-reduced with an autograd-aware
    collective, so N processes give the loss and gradients of one process on the global batch.

    Args:
        backbone: Feature extractor (ViT or ResNet; see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (2048, lightly / the paper's code).
        projection_dim: Output size of the projector (64 in lightly's head).
        projection_layers: Linear layers of the projector (3).
        head_batch_norm: BatchNorm after each hidden Linear (on in the paper's code). Turn off
            for BatchNorm-free models (exact-DDP tests), since BatchNorm statistics are per rank.
        lambda_sigreg: λ, weight of SIGReg; the invariance term gets 1 − λ (0.05).
        num_global_views: G, the leading views whose mean is the invariance target (2).
        num_slices: SIGReg directions per step (1024, lightly).
        sigreg_knots: SIGReg trapezoid points on [0, sigreg_t_max] (17).
        sigreg_t_max: SIGReg integration range (3).
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    views_used = None  # every multi-crop view
    min_global_batch = 2
    min_global_batch_reason = "SIGReg tests the distribution of the global batch's embeddings"

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 64,
        projection_layers: int = 3,
        head_batch_norm: bool = True,
        lambda_sigreg: float = 0.05,
        num_global_views: int = 2,
        num_slices: int = 1024,
        sigreg_knots: int = 17,
        sigreg_t_max: float = 3.0,
        projector: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        self.projector = self.build_mlp_projector(
            projector, projection_hidden_dim, projection_dim, projection_layers, head_batch_norm)
        self.lambda_sigreg, self.num_global_views = lambda_sigreg, num_global_views
        self.num_slices, self.sigreg_knots = num_slices, sigreg_knots
        self.sigreg_t_max = sigreg_t_max

    def build_criterion(self) -> LeJEPALoss:
        return LeJEPALoss(self.lambda_sigreg, self.num_global_views, self.num_slices,
                          self.sigreg_knots, self.sigreg_t_max)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        return self.project_views(views, max(2, self.num_global_views))

    def sigreg_directions(self, dim: int, like: Tensor) -> Tensor:
        """This step's (dim, num_slices) SIGReg directions, identical on every rank."""
        return sigreg_directions(dim, self.num_slices,
                                 self.step_generator(SIGREG_STREAM), like.device, like.dtype)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z = outputs["z"]
        sigreg, invariance = self.criterion.terms(
            z, self.sigreg_directions(z.shape[-1], z), all_reduce_sum_with_grad)
        self.log_terms("lejepa", (("sigreg", sigreg), ("invariance", invariance)), z.shape[0])
        lam = self.criterion.lambda_sigreg
        return lam * sigreg + (1 - lam) * invariance
