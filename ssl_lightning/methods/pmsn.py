"""PMSN: Assran et al., "The Hidden Uniform Cluster Prior in Self-Supervised Learning", ICLR 2023.

:class:`~ssl_lightning.methods.MSN` with the mean-entropy regulariser (a KL divergence of the
mean anchor prediction to the uniform distribution) replaced by the KL divergence to a power
law ``π_k ∝ k^{−s}`` (§5, Prior Matching for Siamese Networks; s = 0.25 in lightly's PMSN).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.losses import MSNLoss
from ssl_lightning.methods.msn import MSN
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method, small_vit


@register_method(
    "pmsn", title="PMSN", configs=("pmsn.yaml",),
    paper=Paper("The Hidden Uniform Cluster Prior in Self-Supervised Learning",
                2023, "2210.07277"),
    family="clustering", views=MULTI_CROP, tests="tests/methods/test_pmsn.py",
    backbone=small_vit,
    small=lambda backbone, **kw: PMSN(backbone, projection_hidden_dim=16, projection_dim=8,
                                      head_batch_norm=False, num_prototypes=10, mask_ratio=0.25,
                                      image_size=8, momentum_base=0.9, **kw),
)
class PMSN(MSN):
    """MSN with a power-law prior on the mean prediction.

    Args:
        backbone: See :class:`MSN`.
        power_law_exponent: s >= 0 of the prior ``π_k ∝ k^{−s}`` (0.25; 0 is MSN).
        **kwargs: Other arguments of :class:`MSN`.
    """

    def __init__(self, backbone: nn.Module, power_law_exponent: float = 0.25,
                 **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.power_law_exponent = power_law_exponent

    def build_criterion(self) -> nn.Module:
        return MSNLoss(self.temperature, self.sharpen_temperature, self.sinkhorn_iterations,
                       self.regularization_weight, self.power_law_exponent)
