"""W-MSE: Ermolov et al., "Whitening for Self-Supervised Representation Learning", ICML 2021.
Views through one network (backbone + projector); the embeddings of random sub-batches of the
global batch are whitened (Cholesky) and the whitened views of a sample pulled together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.distributed import sampler_order
from ssl_lightning.losses import WMSELoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method

#: :meth:`~ssl_lightning.training.step_rng.SeededSteps.step_generator` stream of the splits.
WHITENING_STREAM = 2


@register_method(
    "wmse", title="W-MSE", configs=("wmse.yaml",),
    paper=Paper("Whitening for Self-Supervised Representation Learning", 2021, "2007.06346"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_wmse.py",
    cli_args={
        "wmse.yaml": ("--model.init_args.whitening_size", "4",
                      "--model.init_args.projection_dim", "2"),
    },
    matrix_args={
        "wmse.yaml": ("--model.init_args.whitening_size", "4",
                      "--model.init_args.projection_dim", "2"),
    },
    small=lambda backbone, **kw: WMSE(backbone, projection_hidden_dim=16, projection_dim=3,
                                      head_batch_norm=False, whitening_size=4, **kw),
    position_keyed=True,
)
class WMSE(SSLMethod):
    """W-MSE.

    The embeddings are gathered from all ranks with gradients; the sub-batch permutations come
    from the step's shared seed (:meth:`step_generator`), the same on every rank, and permute the
    samples' global sampler positions (:func:`~ssl_lightning.distributed.sampler_order`), so N
    processes whiten exactly the sub-batches of one process fed the global batch in the
    sampler's order. The global batch must be
    a multiple of ``whitening_size`` (checked before the first step).

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projector (1024).
        projection_dim: Output size D of the projector (64; must be below ``whitening_size``).
        projection_layers: Linear layers of the projector (2).
        head_batch_norm: BatchNorm after each hidden Linear. Turn off for BatchNorm-free
            models (exact-DDP tests), since BatchNorm statistics are per rank.
        whitening_size: w, samples per whitening sub-batch (128).
        whitening_iters: Random splits per step, the loss averaged over them (1).
        whitening_eps: ε, covariance shrinkage towards the identity (0).
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    views_used = None  # every pair of views (W-MSE 2, W-MSE 4, ...)
    min_global_batch_reason = "the embeddings are whitened over sub-batches of whitening_size"

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 1024,
        projection_dim: int = 64,
        projection_layers: int = 2,
        head_batch_norm: bool = True,
        whitening_size: int = 128,
        whitening_iters: int = 1,
        whitening_eps: float = 0.0,
        projector: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        if whitening_size <= projection_dim:
            raise ValueError(
                f"whitening_size={whitening_size} must exceed projection_dim={projection_dim}: "
                "the covariance of a sub-batch is singular otherwise. Raise whitening_size or "
                "lower projection_dim.")
        if whitening_iters < 1:
            raise ValueError(f"whitening_iters must be >= 1, got {whitening_iters}.")
        self.min_global_batch = whitening_size
        self.projector = self.build_mlp_projector(
            projector, projection_hidden_dim, projection_dim, projection_layers, head_batch_norm)
        self.whitening_size, self.whitening_eps = whitening_size, whitening_eps
        self.whitening_iters = whitening_iters

    def build_criterion(self) -> WMSELoss:
        return WMSELoss(self.whitening_size, self.whitening_eps)

    def check_global_batch(self) -> None:
        """Also refuse a global batch that ``whitening_size`` does not divide."""
        super().check_global_batch()
        batch_size = getattr(self.trainer.train_dataloader, "batch_size", None)
        size = self.whitening_size
        if isinstance(batch_size, int) and (batch_size * self.trainer.world_size) % size:
            raise ValueError(
                f"WMSE whitening_size={size} must divide the global batch (batch_size="
                f"{batch_size} x {self.trainer.world_size} process(es)); choose a "
                "whitening_size that divides it or change the batch size.")

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        return self.project_views(views)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z = outputs["z"]
        v_all = self.gather(z)
        generator = self.step_generator(WHITENING_STREAM)
        # permutations of the sampler positions, as rows of the rank-major gathered batch
        rows = sampler_order(torch.arange(len(v_all)), len(v_all) // len(z))
        permutations = [rows[torch.randperm(len(v_all), generator=generator)]
                        for _ in range(self.whitening_iters)]
        return self.criterion(v_all, permutations, self.rank_offset(len(z)), len(z))
