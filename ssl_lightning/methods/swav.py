"""SwAV: Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster
Assignments", NeurIPS 2020.

Backbone → projection MLP → L2 normalisation → prototype scores for every multi-crop view;
Sinkhorn codes of the 2 global crops are predicted from all other crops (:class:`SwAVLoss`).
Prototypes are normalised before every step and frozen for the first iterations; an optional
queue of past embeddings joins the Sinkhorn input from a chosen epoch on.

The queue is stored *globally*: every rank keeps the same buffer of the last ``queue_size``
embeddings of the global batch (gathered across ranks) and feeds its 1/world share to the
distributed Sinkhorn. Together the shares are exactly the single-process queue, and since every
rank holds the same buffer, the checkpoint Lightning writes from rank 0 resumes every rank
exactly (a per-rank buffer would be overwritten by rank 0's on resume).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.distributed import all_gather_no_grad, rank, world_size
from ssl_lightning.heads import ProjectionHead, SwAVPrototypes
from ssl_lightning.losses import SwAVLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method

CROPS_FOR_ASSIGN = (0, 1)


@register_method(
    "swav", title="SwAV", configs=("swav.yaml",),
    paper=Paper("Unsupervised Learning of Visual Features by Contrasting Cluster Assignments",
                2020, "2006.09882"),
    family="clustering", views=MULTI_CROP, tests="tests/methods/test_swav.py",
    small=lambda backbone, **kw: SwAV(backbone, projection_hidden_dim=16, projection_dim=8,
                                      head_batch_norm=False, num_prototypes=10,
                                      freeze_prototypes_steps=1, queue_size=16,
                                      queue_start_epoch=0, **kw),
)
class SwAV(SSLMethod):
    """SwAV with multi-crop.

    Training batches hold ``[global_1, global_2, local_1, ...]`` views
    (:class:`~ssl_lightning.data.multicrop.MultiCropViews`); codes are computed for the 2 global
    crops.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the 2-layer projection MLP (2048).
        projection_dim: Embedding size (128).
        head_batch_norm: BatchNorm in the projection MLP (off for BatchNorm-free tests).
        num_prototypes: K (3000 on ImageNet; a few hundred for CIFAR-10).
        temperature: τ of the prediction softmax (0.1).
        sinkhorn_epsilon: ε (0.05).
        sinkhorn_iterations: Sinkhorn rounds (3).
        freeze_prototypes_steps: Optimiser steps during which the prototypes are not updated
            (5005 = 1 ImageNet epoch at batch 256 in the paper).
        queue_size: Embeddings kept per assigned crop (global, all ranks); 0 disables the queue.
            Must be divisible by the number of processes.
        queue_start_epoch: First epoch in which the queue is filled; it joins the Sinkhorn input
            once full.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        projection_batch_norm: Deprecated name of ``head_batch_norm``.
        queue_length: Deprecated name of ``queue_size``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "Sinkhorn spreads the global batch evenly over the prototypes; one sample gets uniform "
        "codes and nothing to predict"
    )
    views_used = None  # every multi-crop view

    queue: Tensor
    queue_filled: Tensor

    renamed_arguments = {"projection_batch_norm": "head_batch_norm", "queue_length": "queue_size"}

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        head_batch_norm: bool = True,
        num_prototypes: int = 3000,
        temperature: float = 0.1,
        sinkhorn_epsilon: float = 0.05,
        sinkhorn_iterations: int = 3,
        freeze_prototypes_steps: int = 5005,
        queue_size: int = 0,
        queue_start_epoch: int = 15,
        projector: nn.Module | None = None,
        *,
        projection_batch_norm: bool | None = None,
        queue_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "projection_batch_norm", projection_batch_norm,
                                           head_batch_norm)
        queue_size = renamed_argument(self, "queue_length", queue_length, queue_size)
        super().__init__(backbone, **kwargs)
        for name, value in (("freeze_prototypes_steps", freeze_prototypes_steps),
                            ("queue_size", queue_size),
                            ("queue_start_epoch", queue_start_epoch)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, num_layers=2,
            batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.prototypes = SwAVPrototypes(projection_dim, num_prototypes)
        self.register_buffer("queue", torch.zeros(len(CROPS_FOR_ASSIGN), queue_size,
                                                  projection_dim))
        self.register_buffer("queue_filled", torch.zeros((), dtype=torch.long))
        self.temperature, self.sinkhorn_epsilon = temperature, sinkhorn_epsilon
        self.sinkhorn_iterations = sinkhorn_iterations
        self.queue_start_epoch = queue_start_epoch
        self.freeze_prototypes_steps = freeze_prototypes_steps

    def build_criterion(self) -> nn.Module:
        return SwAVLoss(self.temperature, self.sinkhorn_epsilon, self.sinkhorn_iterations,
                        CROPS_FOR_ASSIGN)

    def setup(self, stage: str) -> None:
        """Check ``queue_size`` against the process count at start-up, not when the queue
        starts (``queue_start_epoch``)."""
        super().setup(stage)
        length, world = self.queue.shape[1], self.trainer.world_size
        if length % world:
            low, high = length // world * world, (length // world + 1) * world
            raise ValueError(
                f"SwAV queue_size={length} is not divisible by the {world} processes "
                f"(devices x nodes): every process holds queue_size / {world} of the queue. "
                f"Use queue_size: {high}" + (f" or {low}." if low else ".")
            )

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """Prototype scores of every crop and the embeddings of the assigned crops. The
        prototypes are normalised first (idempotent, so re-running a micro-batch is harmless)."""
        if len(views) < 2:
            raise ValueError(f"SwAV needs 2 global views (+ local views), got {len(views)}.")
        self.prototypes.normalize_()
        batch = views[0].shape[0]
        features = forward_by_resolution(self.backbone, views)
        z = F.normalize(self.projector(features), dim=1)
        z_per_crop = z.chunk(len(views))
        return {"scores": list(self.prototypes(z).chunk(len(views))),
                "assigned": [z_per_crop[c] for c in CROPS_FOR_ASSIGN],
                "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        queue_active = (self.queue.shape[1] > 0
                        and self.current_epoch >= self.queue_start_epoch)
        queue_scores = None
        if queue_active and int(self.queue_filled) >= self.queue.shape[1]:
            with torch.no_grad():
                queue_scores = [self.prototypes(q) for q in self.queue_share()]
        loss = self.criterion(outputs["scores"], queue_scores)
        if queue_active:
            self.push_to_queue(outputs["assigned"])
        return loss

    def queue_share(self) -> Tensor:
        """This rank's 1/world slice of the global queue: (n_assigned, queue_size/world, D)."""
        world = world_size()
        if self.queue.shape[1] % world:
            raise ValueError(
                f"queue_size ({self.queue.shape[1]}) must be divisible by the number of "
                f"processes ({world})."
            )
        return self.queue.chunk(world, dim=1)[rank()]

    @torch.no_grad()
    def push_to_queue(self, assigned: Sequence[Tensor]) -> None:
        """Prepend the global batch's embeddings of the assigned crops (one (B, D) tensor per
        crop of ``CROPS_FOR_ASSIGN``), dropping the oldest."""
        for i, z in enumerate(assigned):
            new = all_gather_no_grad(z.detach())
            self.queue[i] = torch.cat([new, self.queue[i]])[: self.queue.shape[1]]
        self.queue_filled.add_(assigned[0].shape[0] * world_size())
        self.queue_filled.clamp_(max=self.queue.shape[1])

    def freeze_prototypes_(self, step: int) -> None:
        """Drop the prototypes' gradients during the first ``freeze_prototypes_steps`` steps."""
        if step < self.freeze_prototypes_steps:
            for p in self.prototypes.parameters():
                p.grad = None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.freeze_prototypes_(self.trainer.global_step)
        super().on_before_optimizer_step(optimizer)  # the weight-decay schedule
