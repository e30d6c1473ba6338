"""VIbCReg: Lee & Aune, "VIbCReg: Variance-Invariance-better-Covariance Regularization for
Self-Supervised Learning on Time Series", arXiv 2109.00783 (2021). VICReg with a GELU expander
ending in IterNorm (iterative whitening) and a covariance term on the normalised (correlation)
matrix of the embeddings."""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.heads import IterNorm
from ssl_lightning.losses import VIbCRegLoss
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.methods.vicreg import VICReg


@register_method(
    "vibcreg", title="VIbCReg", configs=("vibcreg.yaml",),
    paper=Paper("VIbCReg: Variance-Invariance-better-Covariance Regularization for "
                "Self-Supervised Learning on Time Series",
                2021, "2109.00783"),
    family="non-contrastive", views=TWO_VIEWS, tests="tests/methods/test_vibcreg.py",
    # IterNorm, like BatchNorm, normalises each micro-batch by its own statistics: off here.
    small=lambda backbone, **kw: VIbCReg(backbone, expander_hidden_dim=16, expander_dim=16,
                                         head_batch_norm=False, iternorm=False,
                                         covariance_weight=1.0, **kw),
)
class VIbCReg(VICReg):
    """VIbCReg.

    The expander is Linear-BN-GELU blocks and a final Linear, followed by :class:`IterNorm`
    (its running statistics are buffers in the checkpoint; its batch statistics are over all
    ranks, like ``SyncBatchNorm``). Like BatchNorm, IterNorm normalises each micro-batch by its
    own statistics under ``micro_batch_size``.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        expander_hidden_dim: Hidden width of the expander (2048 for CIFAR, solo-learn).
        expander_dim: Output size of the expander (2048).
        expander_layers: Linear layers of the expander (3).
        head_batch_norm: BatchNorm after each hidden Linear.
        invariance_weight: λ (25).
        variance_weight: μ (25), on the sum of both views' hinges.
        covariance_weight: ν (200), on the normalised covariance term.
        iternorm: Append IterNorm to the expander (on in the paper and solo-learn).
        iternorm_groups: IterNorm groups G (64); must divide ``expander_dim``.
        iternorm_iterations: Newton–Schulz iterations T (5).
        expander: An expander to use instead of the MLP (+ IterNorm) above.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    expander_activation = nn.GELU  # the paper's GELU expander; its last Linear has a bias
    expander_last_bias = True

    def __init__(
        self,
        backbone: nn.Module,
        expander_hidden_dim: int = 2048,
        expander_dim: int = 2048,
        expander_layers: int = 3,
        head_batch_norm: bool = True,
        invariance_weight: float = 25.0,
        variance_weight: float = 25.0,
        covariance_weight: float = 200.0,
        iternorm: bool = True,
        iternorm_groups: int = 64,
        iternorm_iterations: int = 5,
        expander: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if iternorm and expander is None and (iternorm_groups < 1
                                              or expander_dim % iternorm_groups):
            raise ValueError(f"iternorm_groups={iternorm_groups} must be >= 1 and divide "
                             f"expander_dim={expander_dim}.")
        if iternorm_iterations < 1:
            raise ValueError(f"iternorm_iterations must be >= 1, got {iternorm_iterations}.")
        self._iternorm = (iternorm, iternorm_groups, iternorm_iterations)
        super().__init__(backbone, expander_hidden_dim, expander_dim, expander_layers,
                         head_batch_norm, invariance_weight, variance_weight, covariance_weight,
                         expander, **kwargs)

    def default_expander(self, hidden_dim: int, out_dim: int, layers: int,
                         batch_norm: bool) -> nn.Module:
        """VICReg's expander with GELU and a biased last layer, then IterNorm."""
        mlp = super().default_expander(hidden_dim, out_dim, layers, batch_norm)
        enabled, groups, iterations = self._iternorm
        return nn.Sequential(mlp, IterNorm(out_dim, groups, iterations)) if enabled else mlp

    def build_criterion(self) -> VIbCRegLoss:
        return VIbCRegLoss(self.invariance_weight, self.variance_weight, self.covariance_weight)
