"""DirectCLR: Jing, Vincent, LeCun & Tian, "Understanding Dimensional Collapse in Contrastive
Self-supervised Learning", ICLR 2022, §6.

SimCLR without a projector: NT-Xent (negatives from all ranks) directly on the first ``loss_dim``
coordinates of the backbone representation, ``z = r[:d0]``. The paper shows that a linear
projector only needs to act as a low-rank selector, so the loss on a fixed sub-vector trains the
whole representation (the gradient reaches the other coordinates through the backbone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.losses import NTXentLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method


@register_method(
    "directclr", title="DirectCLR", configs=("directclr.yaml",),
    paper=Paper("Understanding Dimensional Collapse in Contrastive Self-supervised Learning",
                2022, "2110.09348"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_directclr.py",
    cli_args={
        "directclr.yaml": (*SMALL_CONVNET_ARGS, "--model.init_args.loss_dim", "8"),
    },
    matrix_args={
        "directclr.yaml": ("--model.init_args.loss_dim", "8"),
    },
    small=lambda backbone, **kw: DirectCLR(backbone, loss_dim=8, **kw),
)
class DirectCLR(SSLMethod):
    """DirectCLR.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        loss_dim: d0, the leading feature coordinates the loss sees (360 of ResNet-50's 2048 in
            the paper); at most the backbone's feature size.
        temperature: NT-Xent temperature (0.5: lightly's ``DirectCLRLoss`` and SimCLR's CIFAR-10
            value, B.9).
        loss_chunk_size: Anchor rows per block of the chunked NT-Xent; ``None`` for dense logits.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "NT-Xent's negatives are the other samples of the global batch; with one sample the "
        "loss is exactly 0"
    )

    def __init__(
        self,
        backbone: nn.Module,
        loss_dim: int = 360,
        temperature: float = 0.5,
        loss_chunk_size: int | None = 1024,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        self.temperature, self.loss_chunk_size = temperature, loss_chunk_size
        self.loss_dim = loss_dim
        if not 1 <= loss_dim <= self.feature_dim:
            raise ValueError(f"DirectCLR loss_dim must be in [1, {self.feature_dim}] (the "
                             f"backbone's feature size), got {loss_dim}; lower it.")

    def build_criterion(self) -> nn.Module:
        return NTXentLoss(self.temperature, self.loss_chunk_size)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        batch, dim = views[0].shape[0], self.loss_dim
        features = self.backbone(torch.cat([views[0], views[1]]))
        z1, z2 = features[:, :dim].chunk(2)
        return {"z1": z1, "z2": z2, "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2 = outputs["z1"], outputs["z2"]
        return self.criterion(z1, z2, self.gather(z1), self.gather(z2),
                              self.rank_offset(z1.shape[0]))
