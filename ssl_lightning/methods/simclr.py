"""SimCLR: Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations",
ICML 2020. Two augmented views, a projection MLP, NT-Xent with negatives from all ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import NTXentLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method


@register_method(
    "simclr", title="SimCLR", configs=("simclr.yaml",),
    paper=Paper("A Simple Framework for Contrastive Learning of Visual Representations",
                2020, "2002.05709"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_simclr.py",
    small=lambda backbone, **kw: SimCLR(backbone, projection_hidden_dim=16, projection_dim=8,
                                        head_batch_norm=False, **kw),
)
class SimCLR(SSLMethod):
    """SimCLR.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projection MLP.
        projection_dim: Output size of the projection MLP (128 in the paper).
        projection_layers: Linear layers in the projection MLP (2 in v1, 3 in v2).
        head_batch_norm: BatchNorm inside the projection MLP.
        temperature: NT-Xent temperature.
        loss_chunk_size: Anchor rows per block of the memory-efficient NT-Xent; ``None`` for the
            dense logit matrix (see :class:`NTXentLoss`).
        margin: Additive margin on the positive cosine of NT-Xent (>= 0; 0 is SimCLR).
        queue_size: Negatives from a memory bank (a queue) of this many past view-2
            embeddings instead of the batch (0, SimCLR: none); a multiple of the global batch (see
            :class:`NTXentLoss`).
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        projection_batch_norm: Deprecated name of ``head_batch_norm``.
        memory_bank_size: Deprecated name of ``queue_size``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "NT-Xent's negatives are the other samples of the global batch; with one sample the "
        "loss is exactly 0"
    )

    renamed_arguments = {
        "projection_batch_norm": "head_batch_norm",
        "memory_bank_size": "queue_size",
    }

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        projection_layers: int = 2,
        head_batch_norm: bool = True,
        temperature: float = 0.2,
        loss_chunk_size: int | None = 1024,
        margin: float = 0.0,
        queue_size: int = 0,
        projector: nn.Module | None = None,
        *,
        projection_batch_norm: bool | None = None,
        memory_bank_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "projection_batch_norm", projection_batch_norm,
                                           head_batch_norm)
        queue_size = renamed_argument(self, "memory_bank_size", memory_bank_size, queue_size)
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0 (0: no memory bank), got {queue_size}.")
        super().__init__(backbone, **kwargs)
        self.temperature, self.loss_chunk_size = temperature, loss_chunk_size
        self.margin, self.queue_size, self.projection_dim = margin, queue_size, projection_dim
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, projection_layers,
            batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")

    def build_criterion(self) -> nn.Module:
        return NTXentLoss(self.temperature, self.loss_chunk_size, self.margin, self.queue_size,
                          embedding_dim=self.projection_dim)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        batch = views[0].shape[0]
        features = self.backbone(torch.cat([views[0], views[1]]))
        z1, z2 = self.projector(features).chunk(2)
        return {"z1": z1, "z2": z2, "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2 = outputs["z1"], outputs["z2"]
        return self.criterion(z1, z2, self.gather(z1), self.gather(z2),
                              self.rank_offset(z1.shape[0]))
