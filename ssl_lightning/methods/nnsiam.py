"""NNSiam (solo-learn ``nnsiam``): SimSiam whose stop-gradient targets are nearest neighbours.

The NNCLR idea (Dwibedi et al., ICCV 2021) on SimSiam (Chen & He, CVPR 2021): the target of
view 1's prediction is the nearest neighbour of view 2's projection in a support set, a FIFO
queue of normalised view-1 projections of earlier global batches, and vice versa:
``L = D(p1, NN(z2))/2 + D(p2, NN(z1))/2``. The support set is filled from the gathered batch, so it
is the same on every rank and resumes with the checkpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method
from ssl_lightning.methods.simsiam import SimSiam
from ssl_lightning.queues import NearestNeighbourSupport


@register_method(
    "nnsiam", title="NNSiam", configs=("nnsiam.yaml",),
    paper=Paper("With a Little Help from My "
                "Friends: Nearest-Neighbor Contrastive Learning of Visual Representations",
                2021, "2104.14548"),
    family="non-contrastive", views=TWO_VIEWS,
    tests="tests/methods/test_nnsiam.py",
    cli_args={
        "nnsiam.yaml": (*SMALL_CONVNET_ARGS,
                        "--model.init_args.projection_hidden_dim", "64",
                        "--model.init_args.projection_dim", "64",
                        "--model.init_args.predictor_hidden_dim", "32"),
    },
    small=lambda backbone, **kw: NNSiam(backbone, projection_hidden_dim=16, projection_dim=16,
                                        predictor_hidden_dim=8, head_batch_norm=False,
                                        queue_size=16, **kw),
)
class NNSiam(SimSiam):
    """NNSiam: :class:`SimSiam` with nearest-neighbour targets from a support set.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        queue_size: Size of the support set (solo-learn: 65536); a multiple of the global batch.
        **kwargs: Head and optimiser arguments of :class:`SimSiam`.
    """

    batch_coupled_loss: ClassVar[bool] = True  # the step's neighbours come from earlier batches

    def __init__(self, backbone: nn.Module, queue_size: int = 65536, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.support_set = NearestNeighbourSupport(queue_size, self.projection_dim)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1 = outputs["z1"].detach()
        loss = self.criterion(outputs["p1"], outputs["p2"],
                              *self.support_set.neighbours(z1, outputs["z2"]))
        self.support_set.add(self.gather(z1))
        return loss
