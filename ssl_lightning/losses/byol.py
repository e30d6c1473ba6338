"""The BYOL loss: symmetrised normalised mean squared error with a stop-gradient target.

Grill et al., "Bootstrap Your Own Latent", NeurIPS 2020, Eq. (2):
``L = ||q̄ − z̄'||² = 2 − 2·⟨q, z'⟩/(||q||·||z'||)`` between the online prediction q of one view
and the target projection z' of the other, averaged over the batch; the total loss is the sum of
both directions, ``L + L~`` (§3.1). The target gets no gradient.

This is an affine transform of SimSiam's negative cosine, ``4·(1 + NegativeCosineLoss)``, so it
reuses that loss. Every term is per sample: under DDP no gathering is needed.
"""

from __future__ import annotations

from torch import Tensor, nn

from ssl_lightning.losses.negative_cosine import NegativeCosineLoss


class BYOLLoss(nn.Module):
    """``(2 − 2·cos(p1, sg(z2))) + (2 − 2·cos(p2, sg(z1)))``, each term averaged over the batch.

    Values lie in [0, 8]; 0 means every prediction points along its target.
    """

    def __init__(self) -> None:
        super().__init__()
        self.negative_cosine = NegativeCosineLoss()

    def forward(self, p1: Tensor, p2: Tensor, z1: Tensor, z2: Tensor) -> Tensor:
        """Symmetrised BYOL loss of the local batch.

        Args:
            p1: Online predictions of view 1 (B, D).
            p2: Online predictions of view 2 (B, D).
            z1: Target projections of view 1 (B, D), the target of ``p2``; detached.
            z2: Target projections of view 2 (B, D), the target of ``p1``; detached.

        Returns:
            Scalar loss, computed in fp32 even under autocast.
        """
        return 4.0 * (1.0 + self.negative_cosine(p1, p2, z1, z2))
