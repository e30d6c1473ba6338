"""Joint-view clustering of two views' patch tokens into K objects (CrOC / CrIBo).

Stegmüller et al., "CrOC: Cross-View Online Clustering for Dense Visual Representation
Learning" (CVPR 2023), and Lebailly et al., "CrIBo: Self-Supervised Learning via Cross-Image
Object-Level Bootstrapping" (ICLR 2024), §3.1 "Joint-space clustering": the N tokens of view 1
and the N tokens of view 2 of an image are concatenated into 2N tokens and partitioned into K
clusters together, so cluster k names the same object in both views (the cross-view
correspondence comes for free). Per image, on the L2-normalised tokens, as the authors'
``Clustering.compute_assignments`` (``main_cribo.py``) does:

1. the initial centroids are K distinct tokens drawn at random;
2. each round: cost ``M = −z·c`` (rescaled to [0, 1]), an entropic transport plan
   ``P ∝ exp(−λ M)`` from Sinkhorn-Knopp rounds towards the token marginal 1/(2N) and the
   cluster marginal ``c``; each token goes to its largest entry (hard assignment); with
   ``update_marginals`` the cluster marginal becomes the clusters' sizes (+0.01, normalised);
   the centroids become the L2-normalised sums of their tokens.

The rounds here differ from the authors' in two ways, both so that an image's clusters depend
on that image alone (so N processes give what one process gives, and micro-batches what the
whole batch gives): the cost is rescaled per image (the authors rescale by the min and max over
the whole batch), and no positional cost is added (the authors add ``λ_pos`` times a distance
between patch positions in the original image, which needs the crop boxes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.training.grad_cache import whole_batch_draw
from ssl_lightning.training.sample_rng import active_keys, keyed_uniform

#: Key stream of the initial centroids (the forward's other keyed draws use other streams).
_INIT_STREAM = 2


def draw_initial_tokens(batch: int, tokens: int, clusters: int, device: torch.device) -> Tensor:
    """(B, K) indices of K distinct tokens among ``tokens`` per image: from each sample's key
    inside a keyed forward, else from torch's generator (once for the whole batch under gradient
    caching).

    Raises:
        ValueError: ``clusters`` is not in [1, ``tokens``].
    """
    if not 1 <= clusters <= tokens:
        raise ValueError(f"Joint-view clustering needs 1 <= num_objects <= the 2N tokens of an "
                         f"image's two views, got num_objects={clusters} for {tokens} tokens; "
                         "lower num_objects or use larger crops / smaller patches.")
    keys = active_keys()
    if keys is None:
        return whole_batch_draw("joint_view_init", batch, lambda n: torch.rand(
            n, tokens).argsort(dim=1)[:, :clusters]).to(device)
    uniforms = keyed_uniform(keys.streams(_INIT_STREAM).cpu(), tokens)
    return uniforms.argsort(dim=1)[:, :clusters].to(device)


def transport_plan(cost: Tensor, cluster_marginal: Tensor, sharpness: float,
                   iterations: int) -> Tensor:
    """Entropic transport plan (B, T, K) of the cost (B, T, K) in [0, 1]: ``exp(−λ M)``
    normalised to mass 1, then ``iterations`` rounds scaling the rows to 1/T and the columns to
    ``cluster_marginal`` (B, 1, K)."""
    plan = torch.exp(-sharpness * cost)
    plan = plan / plan.sum(dim=(1, 2), keepdim=True)
    for _ in range(iterations):
        plan = plan / plan.sum(dim=2, keepdim=True) / cost.shape[1]
        plan = plan * (cluster_marginal / plan.sum(dim=1, keepdim=True))
    return torch.nan_to_num(plan, nan=1e-8)


@torch.no_grad()
def joint_view_clusters(tokens1: Tensor, tokens2: Tensor, initial: Tensor, iterations: int = 5,
                        sinkhorn_iterations: int = 5, sharpness: float = 20.0,
                        update_marginals: bool = True) -> Tensor:
    """Hard assignments (B, 2N, K) (one-hot rows; view 1's tokens, then view 2's) of the two
    views' tokens (B, N, C) to K joint clusters.

    Args:
        tokens1, tokens2: Patch tokens of the two views of each image.
        initial: (B, K) indices into the 2N joint tokens of the initial centroids
            (:func:`draw_initial_tokens`).
        iterations: Assignment + update rounds (CrIBo: 5, ``n_iter``).
        sinkhorn_iterations: Sinkhorn-Knopp rounds per assignment (5).
        sharpness: λ of ``exp(−λ M)`` (20, ``sinkhorn_lambda``).
        update_marginals: Set the cluster marginal to the cluster sizes after each round
            (``update_c``, on in CrIBo's released runs).
    """
    if tokens1.dim() != 3 or tokens1.shape != tokens2.shape:
        raise ValueError(f"Expected the two views' tokens as (B, N, C) each, got "
                         f"{tuple(tokens1.shape)} and {tuple(tokens2.shape)}.")
    if iterations < 1 or sinkhorn_iterations < 1:
        raise ValueError(f"Clustering needs >= 1 round and >= 1 Sinkhorn round, got "
                         f"{iterations} and {sinkhorn_iterations}.")
    with torch.autocast(device_type=tokens1.device.type, enabled=False):
        dtype = torch.promote_types(tokens1.dtype, torch.float32)
        tokens = F.normalize(torch.cat([tokens1, tokens2], dim=1).to(dtype), dim=2)
        batch, count, _ = tokens.shape
        clusters = initial.shape[1]
        centroids = torch.gather(tokens, 1, initial[:, :, None].expand(-1, -1, tokens.shape[2]))
        marginal = tokens.new_full((batch, 1, clusters), 1.0 / clusters)
        hard = tokens.new_zeros(batch, count, clusters)
        for _ in range(iterations):
            cost = -tokens @ centroids.transpose(1, 2)
            low = cost.amin(dim=(1, 2), keepdim=True)
            span = (cost.amax(dim=(1, 2), keepdim=True) - low).clamp_min(
                torch.finfo(dtype).tiny)
            plan = transport_plan((cost - low) / span, marginal, sharpness, sinkhorn_iterations)
            hard = F.one_hot(plan.argmax(dim=2), clusters).to(dtype)
            if update_marginals:
                marginal = hard.sum(dim=1, keepdim=True) + 1e-2
                marginal = marginal / marginal.sum(dim=2, keepdim=True)
            centroids = F.normalize(hard.transpose(1, 2) @ tokens, dim=2)
        return hard
