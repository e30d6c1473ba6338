"""FastSiam: Pototzky et al., "FastSiam: Resource-Efficient Self-supervised Learning on a Single
GPU", GCPR 2022.

SimSiam with K views per image (4 in the paper): every view's prediction is compared with the
mean of the stop-gradient projections of the other K − 1 views (:class:`FastSiamLoss`), a
less noisy target that lets small batches train stably. Heads, predictor learning rate and the
absence of cross-rank statistics are SimSiam's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ssl_lightning.losses import FastSiamLoss
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, Paper, register_method
from ssl_lightning.methods.simsiam import SimSiam


@register_method(
    "fastsiam", title="FastSiam", configs=("fastsiam.yaml",),
    paper=Paper("FastSiam: Resource-Efficient Self-supervised Learning on a Single GPU", 2022),
    family="non-contrastive", views=(8, 8, 8), tests="tests/methods/test_fastsiam.py",
    cli_args={
        "fastsiam.yaml": (*SMALL_CONVNET_ARGS,
                          "--model.init_args.projection_hidden_dim", "64",
                          "--model.init_args.projection_dim", "64",
                          "--model.init_args.predictor_hidden_dim", "32"),
    },
    small=lambda backbone, **kw: FastSiam(backbone, num_views=3, projection_hidden_dim=16,
                                          projection_dim=16, predictor_hidden_dim=8,
                                          head_batch_norm=False, **kw),
)
class FastSiam(SimSiam):
    """FastSiam: :class:`SimSiam` on ``num_views`` views with the mean-of-others target.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        num_views: Views per image K >= 2 (4 in the paper); the train transform must make them
            (``DeviceViews`` / ``SimCLRViews`` ``num_views``).
        **kwargs: Head and optimiser arguments of :class:`SimSiam`.
    """

    def __init__(self, backbone: nn.Module, num_views: int = 4, **kwargs: Any) -> None:
        if num_views < 2:
            raise ValueError(f"FastSiam needs num_views >= 2 (each view's target is the mean of "
                             f"the others), got {num_views}; the paper uses 4.")
        super().__init__(backbone, **kwargs)
        self.views_used = self.num_views = num_views

    def build_criterion(self) -> nn.Module:
        return FastSiamLoss()

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        views = views[: self.num_views]
        self.require_views(views, self.num_views)
        features = [self.backbone(v) for v in views]
        z = [self.projector(f) for f in features]
        return {"p": [self.predictor(t) for t in z], "z": z, "features": features[0]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["p"], outputs["z"])
