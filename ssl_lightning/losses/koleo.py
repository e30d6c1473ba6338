"""KoLeo regulariser: spread features uniformly by pushing each away from its nearest neighbour.

Sablayrolles et al., "Spreading vectors for similarity search", ICLR 2019 (the Kozachenko-Leonenko
differential-entropy estimator); used on the student's [CLS] features by Oquab et al., "DINOv2:
Learning Robust Visual Features without Supervision", TMLR 2024, §4:
``L = −(1/n) Σ_i log(ρ_i + ε)`` with ``ρ_i = min_{j≠i} ||x̂_i − x̂_j||`` and ``x̂ = x / ||x||``.

Official DINOv2 takes the neighbours within each GPU's batch. Here the method passes the features
gathered over all ranks as candidates (with gradients), so N processes equal one process holding
the global batch; passing only the local batch as candidates gives the per-GPU variant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


class KoLeoLoss(nn.Module):
    """Mean of ``−log(distance to the nearest other candidate + eps)`` over the local samples.

    Args:
        eps: Added to the distance inside the log, and the L2-normalisation floor (1e-8).
    """

    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        if not eps > 0:
            raise ValueError(f"KoLeo eps must be > 0, got {eps}.")
        self.eps = eps

    def forward(self, local: Tensor, candidates: Tensor | None = None, offset: int = 0) -> Tensor:
        """KoLeo loss of this rank's samples.

        Args:
            local: Features (B, D) of this rank.
            candidates: Features (M, D) among which neighbours are searched, containing
                ``local`` at rows ``offset … offset + B − 1`` (the gathered global batch);
                None: ``local`` itself.
            offset: Row of ``local[0]`` in ``candidates``.

        Returns:
            Scalar loss (fp32, or float64 for float64 inputs).
        """
        if candidates is None:
            candidates, offset = local, 0
        batch = local.shape[0]
        if candidates.shape[0] < 2 or not 0 <= offset <= candidates.shape[0] - batch:
            raise ValueError(
                f"KoLeo needs >= 2 candidates containing the {batch} local rows at offset "
                f"{offset}, got {candidates.shape[0]} candidates."
            )
        with torch.autocast(device_type=local.device.type, enabled=False):
            x = F.normalize(at_least_fp32(local), dim=-1, eps=self.eps)
            c = F.normalize(at_least_fp32(candidates), dim=-1, eps=self.eps)
            with torch.no_grad():
                sims = x @ c.T
                rows = torch.arange(batch, device=x.device)
                sims[rows, rows + offset] = -torch.inf
                neighbours = sims.argmax(dim=1)
            distances = torch.linalg.vector_norm(x - c[neighbours], dim=-1)
            return -(distances + self.eps).log().mean()
