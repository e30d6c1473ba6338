"""SupCon: Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020.

SimCLR's two views and projection MLP trained with the supervised contrastive loss: every view
of every sample of the same class is a positive. The class labels are the batch's targets
(``outputs["targets"]``, set by :meth:`SSLMethod.training_loss` from the training batch); they
are gathered across ranks with the embeddings. Needs labelled data: a batch with target -1
(unlabelled) raises a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import SupConLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method


@register_method(
    "supcon", title="SupCon", configs=("supcon.yaml",),
    paper=Paper("Supervised Contrastive Learning", 2020, "2004.11362"),
    family="contrastive", views=TWO_VIEWS, docs="docs/contrastive_methods.md",
    tests="tests/methods/test_supcon.py",
    small=lambda backbone, **kw: SupCon(backbone, projection_hidden_dim=16, projection_dim=8,
                                        head_batch_norm=False, **kw),
)
class SupCon(SSLMethod):
    """Supervised contrastive learning.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the projection MLP (2048 in the paper).
        projection_dim: Embedding size (128 in the paper).
        projection_layers: Linear layers of the projection MLP (2 in the paper).
        head_batch_norm: BatchNorm in the projection MLP.
        temperature: SupCon temperature (0.1 in the paper).
        loss_chunk_size: Anchor rows per block of the chunked loss; ``None`` for dense logits.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        projection_batch_norm: Deprecated name of ``head_batch_norm``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    renamed_arguments = {"projection_batch_norm": "head_batch_norm"}

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        projection_layers: int = 2,
        head_batch_norm: bool = True,
        temperature: float = 0.1,
        loss_chunk_size: int | None = 1024,
        projector: nn.Module | None = None,
        *,
        projection_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "projection_batch_norm", projection_batch_norm,
                                           head_batch_norm)
        super().__init__(backbone, **kwargs)
        self.temperature, self.loss_chunk_size = temperature, loss_chunk_size
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, projection_layers,
            batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")

    def build_criterion(self) -> nn.Module:
        return SupConLoss(self.temperature, self.loss_chunk_size)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        batch = views[0].shape[0]
        features = self.backbone(torch.cat([views[0], views[1]]))
        z1, z2 = self.projector(features).chunk(2)
        return {"z1": z1, "z2": z2, "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        if "targets" not in outputs:
            raise ValueError("SupCon needs the batch's class labels as outputs['targets'] "
                             "(training_step passes them; call training_loss(views, targets)).")
        z1, z2, labels = outputs["z1"], outputs["z2"], outputs["targets"]
        return self.criterion(z1, z2, labels, self.gather(z1), self.gather(z2),
                              self.gather(labels), self.rank_offset(z1.shape[0]))
