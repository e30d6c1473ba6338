"""DCL and DCLW, the decoupled contrastive losses.

Yeh et al., "Decoupled Contrastive Learning", ECCV 2022, Eq. (6): NT-Xent with the positive pair
removed from the denominator (the "negative-positive coupling" it causes is what DCL removes),

``L_i = -s_i+ + log sum_{k in N(i)} exp(s_ik)``,  ``s = z·z' / T``,

where N(i) are the 2N - 2 other embeddings of the batch (both views, neither z_i nor its
positive). DCLW (Eq. 7) weights the positive term with the von Mises-Fisher weight
``w_i = 2 - exp(z_i·z_i+ / σ) / E_j[exp(z_j·z_j+ / σ)]`` (σ = 0.5 in the paper), the mean over
the (global) batch; as in the authors' code the weight is differentiated through.

Both directions (view-1 and view-2 anchors) are averaged, as in our NT-Xent. Under DDP the
candidates and the weights' batch mean come from the gathered global batch, and each rank
averages over its own anchors, so the mean over ranks equals the single-process loss.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.losses.chunked_contrastive import (
    check_loss_settings,
    check_two_views,
    gather_local,
    logsumexp_gap_mean,
    two_view_pairs,
)


class DCLLoss(nn.Module):
    """Decoupled contrastive loss (DCL), or DCLW with ``weight_sigma``.

    Args:
        temperature: Softmax temperature T > 0 (0.1 by default, as in lightly's ``DCLLoss``).
        weight_sigma: σ > 0 of the DCLW weights (0.5 in the paper); ``None`` for plain DCL.
        chunk_size: Anchor rows per block of the chunked log-sum-exp (see
            :class:`NTXentLoss`); ``None`` for the dense logit matrix.
        gather: Gather the candidates inside the loss (see :class:`NTXentLoss`).
    """

    def __init__(
        self,
        temperature: float = 0.1,
        weight_sigma: float | None = None,
        chunk_size: int | None = 1024,
        gather: bool = False,
    ) -> None:
        super().__init__()
        check_loss_settings("DCLLoss", temperature, chunk_size)
        if weight_sigma is not None and not weight_sigma > 0:
            raise ValueError(f"DCLLoss weight_sigma must be > 0 (or None for DCL), got "
                             f"{weight_sigma}.")
        self.temperature = temperature
        self.weight_sigma = weight_sigma
        self.chunk_size = chunk_size
        self.gather = gather

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        z1_all: Tensor | None = None,
        z2_all: Tensor | None = None,
        rank_offset: int | None = None,
    ) -> Tensor:
        """Mean DCL(W) over the 2B local anchors; arguments as in :class:`NTXentLoss`.

        Returns:
            Scalar loss, computed in fp32 (float64 for float64 inputs) even under autocast.
        """
        if self.gather:
            (z1_all, z2_all), rank_offset = gather_local(
                "DCLLoss", [z1, z2], rank_offset, z1_all is not None or z2_all is not None)
        z1_all, z2_all, rank_offset = check_two_views("DCLLoss", z1, z2, z1_all, z2_all,
                                                      rank_offset)
        n_global = z1_all.shape[0]
        with torch.autocast(device_type=z1.device.type, enabled=False):
            anchors, candidates, self_index, positive_index = two_view_pairs(
                z1, z2, z1_all, z2_all, rank_offset)
            excluded = torch.stack([self_index, positive_index], dim=1)
            positive = (anchors * candidates[positive_index]).sum(dim=1) / self.temperature
            if self.weight_sigma is not None:
                cosine_all = (candidates[:n_global] * candidates[n_global:]).sum(dim=1)
                weights = 2 - n_global * torch.softmax(cosine_all / self.weight_sigma, dim=0)
                local = self_index[: z1.shape[0]]  # this rank's samples in the global batch
                positive = positive * weights[local].repeat(2)
            return logsumexp_gap_mean(anchors, candidates, positive, self.temperature, excluded,
                                      self.chunk_size, softplus=False)
