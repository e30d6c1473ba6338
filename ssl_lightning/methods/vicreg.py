"""VICReg: Bardes, Ponce & LeCun, "VICReg: Variance-Invariance-Covariance Regularization for
Self-Supervised Learning", ICLR 2022. Two views, an expander MLP, and a loss whose variance and
covariance terms are statistics of the global batch (embeddings gathered with gradients)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import build_mlp
from ssl_lightning.losses import VICRegLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method


@register_method(
    "vicreg", title="VICReg", configs=("vicreg.yaml",),
    paper=Paper("VICReg: Variance-Invariance-Covariance Regularization "
                "for Self-Supervised Learning",
                2022, "2105.04906"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_vicreg.py",
    small=lambda backbone, **kw: VICReg(backbone, expander_hidden_dim=16, expander_dim=16,
                                        head_batch_norm=False, **kw),
)
class VICReg(SSLMethod):
    """VICReg.

    Each view goes through the backbone and expander separately (BatchNorm statistics per view,
    as in the official code).

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        expander_hidden_dim: Hidden width of the expander (8192 in the paper; 2048 for CIFAR).
        expander_dim: Output size of the expander (8192 in the paper; 2048 for CIFAR).
        expander_layers: Linear layers of the expander (3 in the paper).
        head_batch_norm: BatchNorm after each hidden Linear. Turn off for BatchNorm-free
            models (exact-DDP tests), since BatchNorm statistics are per rank.
        invariance_weight: λ (25 in the paper).
        variance_weight: μ (25 in the paper).
        covariance_weight: ν (1 in the paper).
        expander: An expander to use instead of the MLP above (any module mapping the backbone
            features to ``expander_dim``); the ``expander_*`` widths then only set
            ``expander_dim``.
        expander_batch_norm: Deprecated name of ``head_batch_norm``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = 2
    min_global_batch_reason = (
        "the variance and covariance terms are statistics over the global batch, undefined for "
        "one sample"
    )

    renamed_arguments = {"expander_batch_norm": "head_batch_norm"}
    #: The default expander's activation and whether its last Linear has a bias (VICReg: ReLU,
    #: no bias; a subclass such as VIbCReg changes them).
    expander_activation: ClassVar[type[nn.Module]] = nn.ReLU
    expander_last_bias: ClassVar[bool] = False

    def __init__(
        self,
        backbone: nn.Module,
        expander_hidden_dim: int = 2048,
        expander_dim: int = 2048,
        expander_layers: int = 3,
        head_batch_norm: bool = True,
        invariance_weight: float = 25.0,
        variance_weight: float = 25.0,
        covariance_weight: float = 1.0,
        expander: nn.Module | None = None,
        *,
        expander_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "expander_batch_norm", expander_batch_norm,
                                           head_batch_norm)
        super().__init__(backbone, **kwargs)
        self.invariance_weight, self.variance_weight = invariance_weight, variance_weight
        self.covariance_weight = covariance_weight
        self.expander = self.build_head("expander", expander, lambda: self.default_expander(
            expander_hidden_dim, expander_dim, expander_layers, head_batch_norm,
        ), self.feature_dim, expander_dim, "expander_dim")

    def default_expander(self, hidden_dim: int, out_dim: int, layers: int,
                         batch_norm: bool) -> nn.Module:
        """The expander MLP built when none is injected (a subclass changes its layout here)."""
        return build_mlp(self.feature_dim, hidden_dim, out_dim, layers, batch_norm=batch_norm,
                         last_bias=self.expander_last_bias, activation=self.expander_activation)

    def build_criterion(self) -> VICRegLoss:
        return VICRegLoss(self.invariance_weight, self.variance_weight, self.covariance_weight)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        features = self.backbone(views[0])
        return {"z1": self.expander(features), "z2": self.expander(self.backbone(views[1])),
                "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2 = outputs["z1"], outputs["z2"]
        terms = self.criterion.terms(z1, z2, self.gather(z1), self.gather(z2))
        self.log_terms("vicreg", zip(("invariance", "variance", "covariance"), terms, strict=True),
                       z1.shape[0])
        return self.criterion.combine(*terms)
