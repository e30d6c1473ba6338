"""Sinkhorn-Knopp equipartition of a batch over K prototypes, exact across ranks.

Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster Assignments",
NeurIPS 2020, §3.1 and Algorithm 1 (after Cuturi, 2013): ``Q = exp(C^T Z / ε)`` normalised
alternately so that every prototype receives 1/K of the mass (rows) and every sample 1/B
(columns); after the last column step the columns are rescaled to sum to 1, giving soft codes.

Under DDP each rank holds B_r columns; the row sums and the total are summed over ranks, so N
processes produce exactly the codes one process computes on the concatenated scores.

Leading dimensions are independent problems: CAPI (Darcet et al., "Cluster and Predict Latent
Patches for Improved Masked Image Modeling", arXiv 2502.08769) balances the patches of each
position over the batch separately, ``scores`` (N, B, K).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ssl_lightning.distributed import all_gather_no_grad, all_reduce_sum_no_grad, world_size
from ssl_lightning.losses.numerics import at_least_fp32


@torch.no_grad()
def sinkhorn_knopp(
    scores: Tensor, epsilon: float = 0.05, iterations: int = 3, num_samples: int | None = None
) -> Tensor:
    """Soft assignments (..., B, K) of this rank's samples, each row summing to 1.

    Args:
        scores: Prototype scores (B, K) of this rank (the same B on all ranks unless
            ``num_samples`` is given), or (..., B, K): one problem per leading index.
        epsilon: Entropic regularisation ε > 0 (0.05).
        iterations: Number of row+column normalisation rounds (3).
        num_samples: Total number of samples over all ranks when the ranks hold different
            numbers (iBOT/DINOv2 masked patches; B may be 0 on a rank); None: B × world size.

    Returns:
        Codes in fp32 (float64 for float64 scores), computed outside autograd and autocast.
    """
    if not epsilon > 0:
        raise ValueError(f"Sinkhorn epsilon must be > 0, got {epsilon}.")
    if iterations < 1:
        raise ValueError(f"Sinkhorn iterations must be >= 1, got {iterations}.")
    with torch.autocast(device_type=scores.device.type, enabled=False):
        logits = at_least_fp32(scores) / epsilon
        # A shift per prototype cancels in the first row normalisation. Taking each prototype's
        # maximum over the batch of all ranks (the same on every rank) keeps exp() finite and
        # every prototype row non-zero, however wide the range of the logits.
        local_max = (logits.amax(dim=-2, keepdim=True) if logits.shape[-2]
                     else logits[..., :1, :].new_full((), -math.inf).expand(
                         *logits.shape[:-2], 1, logits.shape[-1]))
        shift = all_gather_no_grad(local_max[None]).amax(dim=0)
        q = torch.exp(logits - shift).transpose(-2, -1)  # (..., K, B)
        num_prototypes = q.shape[-2]
        total_samples = q.shape[-1] * world_size() if num_samples is None else num_samples
        q /= all_reduce_sum_no_grad(q.sum(dim=(-2, -1), keepdim=True))
        for _ in range(iterations):
            q /= all_reduce_sum_no_grad(q.sum(dim=-1, keepdim=True))
            q /= num_prototypes
            q /= q.sum(dim=-2, keepdim=True)
            q /= total_samples
        q *= total_samples
        return q.transpose(-2, -1)
