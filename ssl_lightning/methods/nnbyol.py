"""NNBYOL (solo-learn ``nnbyol``): BYOL whose targets are nearest neighbours of the momentum
projections.

The NNCLR idea (Dwibedi et al., ICCV 2021) on BYOL (Grill et al., NeurIPS 2020): the target of
view 1's prediction is the nearest neighbour of view 2's *momentum* projection in a support set,
a FIFO queue of normalised view-1 momentum projections of earlier global batches, and vice versa:
``L = (2 − 2·cos(p1, NN(z2'))) + (2 − 2·cos(p2, NN(z1')))``. The support set is filled from the
gathered batch, so it is the same on every rank and resumes with the checkpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from ssl_lightning.methods.byol import BYOL
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import NearestNeighbourSupport


@register_method(
    "nnbyol", title="NNBYOL", configs=("nnbyol.yaml",),
    paper=Paper("With a Little Help from My "
                "Friends: Nearest-Neighbor Contrastive Learning of Visual Representations",
                2021, "2104.14548"),
    family="non-contrastive", views=TWO_VIEWS,
    tests="tests/methods/test_nnbyol.py",
    cli_args={
        "nnbyol.yaml": (*SMALL_CONVNET_ARGS, "--model.init_args.projection_hidden_dim", "64"),
    },
    small=lambda backbone, **kw: NNBYOL(backbone, projection_hidden_dim=16, projection_dim=8,
                                        head_batch_norm=False, momentum_base=0.9, queue_size=16,
                                        **kw),
)
class NNBYOL(BYOL):
    """NNBYOL: :class:`BYOL` with nearest-neighbour targets from a support set.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        queue_size: Size of the support set (solo-learn: 65536); a multiple of the global batch.
        **kwargs: Head, momentum and optimiser arguments of :class:`BYOL`.
    """

    batch_coupled_loss: ClassVar[bool] = True  # the step's neighbours come from earlier batches

    def __init__(self, backbone: nn.Module, queue_size: int = 65536, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.support_set = NearestNeighbourSupport(queue_size, self.projection_dim)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2 = outputs["z1"], outputs["z2"]  # momentum projections (no gradient)
        loss = self.criterion(outputs["p1"], outputs["p2"], *self.support_set.neighbours(z1, z2))
        self.support_set.add(self.gather_no_grad(z1))
        return loss
