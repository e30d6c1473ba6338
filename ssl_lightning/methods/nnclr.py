"""NNCLR: Dwibedi et al., "With a Little Help from My Friends: Nearest-Neighbor Contrastive
Learning of Visual Representations", ICCV 2021.

SimCLR's two views, a projection MLP and a prediction MLP; the positive of each view's
prediction is the nearest neighbour of the *other* view's projection in a support set, a FIFO
queue of projections of earlier batches (98,304 in the paper). The support set is filled with
the view-1 projections of the gathered global batch, so it is the same on every rank (and the
same as on one process holding the global batch); it is a persistent buffer and resumes exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import PredictionHead, ProjectionHead
from ssl_lightning.losses import NNCLRLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import NearestNeighbourSupport


@register_method(
    "nnclr", title="NNCLR", configs=("nnclr.yaml",),
    paper=Paper("With a Little Help from My "
                "Friends: Nearest-Neighbor Contrastive Learning of Visual Representations",
                2021, "2104.14548"),
    family="contrastive", views=TWO_VIEWS, docs="docs/contrastive_methods.md",
    tests="tests/methods/test_nnclr.py",
    cli_args={
        "nnclr.yaml": ("--model.init_args.projection_hidden_dim", "64",
                       "--model.init_args.predictor_hidden_dim", "64"),
    },
    small=lambda backbone, **kw: NNCLR(backbone, projection_hidden_dim=16, projection_dim=8,
                                       head_batch_norm=False, predictor_hidden_dim=16,
                                       queue_size=16, **kw),
)
class NNCLR(SSLMethod):
    """NNCLR.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projection MLP (2048 in the paper).
        projection_dim: Embedding size (256 in the paper).
        projection_layers: Linear layers of the projection MLP (3 in the paper).
        predictor_hidden_dim: Hidden width of the 2-layer prediction MLP (4096 in the paper).
        head_batch_norm: BatchNorm in the hidden layers of both MLPs and an affine-free one on
            the projection output (the paper's heads); off for BatchNorm-free DDP tests.
        queue_size: Size of the support set, a queue (98,304 in the paper); a multiple of the
            global batch.
        temperature: Softmax temperature (0.1 in the paper).
        loss_chunk_size: Anchor rows per block of the chunked loss; ``None`` for dense logits.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        predictor: A prediction head to use instead of the MLP above (any module mapping
            ``projection_dim`` to ``projection_dim``).
        prediction_hidden_dim: Deprecated name of ``predictor_hidden_dim``.
        support_set_size: Deprecated name of ``queue_size``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    renamed_arguments = {
        "prediction_hidden_dim": "predictor_hidden_dim",
        "support_set_size": "queue_size",
    }

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 256,
        projection_layers: int = 3,
        predictor_hidden_dim: int = 4096,
        head_batch_norm: bool = True,
        queue_size: int = 98304,
        temperature: float = 0.1,
        loss_chunk_size: int | None = 1024,
        projector: nn.Module | None = None,
        predictor: nn.Module | None = None,
        *,
        prediction_hidden_dim: int | None = None,
        support_set_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        predictor_hidden_dim = renamed_argument(
            self, "prediction_hidden_dim", prediction_hidden_dim, predictor_hidden_dim)
        queue_size = renamed_argument(self, "support_set_size", support_set_size, queue_size)
        super().__init__(backbone, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, projection_layers,
            batch_norm=head_batch_norm, last_batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.predictor = self.build_head("predictor", predictor, lambda: PredictionHead(
            projection_dim, predictor_hidden_dim, projection_dim, batch_norm=head_batch_norm,
        ), projection_dim, projection_dim, "projection_dim")
        self.support_set = NearestNeighbourSupport(queue_size, projection_dim)
        self.temperature, self.loss_chunk_size = temperature, loss_chunk_size

    def build_criterion(self) -> nn.Module:
        return NNCLRLoss(self.temperature, self.loss_chunk_size)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        batch = views[0].shape[0]
        features = self.backbone(torch.cat([views[0], views[1]]))
        z = self.projector(features)
        p = self.predictor(z)
        z1, z2 = z.chunk(2)
        p1, p2 = p.chunk(2)
        return {"z1": z1, "z2": z2, "p1": p1, "p2": p2, "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2, p1, p2 = (outputs[k] for k in ("z1", "z2", "p1", "p2"))
        offset = self.rank_offset(z1.shape[0])
        neighbour1, neighbour2 = self.support_set.neighbours(z1, z2)
        loss = (self.criterion(neighbour1, self.gather(p2), offset)
                + self.criterion(neighbour2, self.gather(p1), offset)) / 2
        self.support_set.add(self.gather(z1.detach()))
        return loss
