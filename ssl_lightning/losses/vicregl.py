"""VICRegL loss: VICReg on global embeddings and on matched local features.

Bardes, Ponce & LeCun, "VICRegL: Self-Supervised Learning of Local Visual Features", NeurIPS
2022, §3 and the authors' ``main_vicregl.py``:

- global: ``λ·s + μ·v̄ + ν·c̄``: the invariance ``s`` (mean squared error) averaged over the
  ordered pairs (a global view, any other view), the variance ``v`` and covariance ``c``
  (:func:`~ssl_lightning.losses.vicreg.variance_term`, ``covariance_term``) averaged over all
  views;
- local, for every such pair (a, b): two matchings of the feature maps' locations,
  each from a to b with ``num_matches[0]`` pairs and from b to a with ``num_matches[1]``
  (:func:`~ssl_lightning.losses.dense_matching.best_matches`): by L2 distance of the local
  features, and by distance of the locations' positions in the original image; each matched set
  (B, K, D) gets the VICReg loss ``λ·s + μ·(v(Z)+v(Z'))/2 + (ν/2)·(c(Z)+c(Z'))`` with the
  statistics over the batch per match slot; the two directions are averaged, the two matchings
  summed, and the pairs averaged;
- ``L = α·global + (1 − α)·local`` (α = 0.75).

Every term is a statistic of the whole batch, so the method passes the inputs gathered from all
ranks (with gradients) and every rank computes the same loss: the backward of the gather sums
each sample's gradient over the W ranks and DDP's averaging divides by W again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.dense_matching import best_matches, gather_locations, pairwise_distance
from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.vicreg import covariance_term, variance_term


class VICRegLLoss(nn.Module):
    """VICRegL's global and local VICReg terms.

    Args:
        invariance_weight: λ (25).
        variance_weight: μ (25).
        covariance_weight: ν (1); the local terms use ν/2 (the authors' code).
        alpha: α, the global term's weight; the local one gets 1 − α (0.75).
        num_matches: Matched pairs kept from a to b and from b to a (20, 4).
        eps: ε of the variance term (1e-4).
    """

    def __init__(self, invariance_weight: float = 25.0, variance_weight: float = 25.0,
                 covariance_weight: float = 1.0, alpha: float = 0.75,
                 num_matches: tuple[int, int] = (20, 4), eps: float = 1e-4) -> None:
        super().__init__()
        for name, value in (("invariance_weight", invariance_weight),
                            ("variance_weight", variance_weight),
                            ("covariance_weight", covariance_weight)):
            if value < 0:
                raise ValueError(f"VICRegLLoss {name} must be >= 0, got {value}.")
        if not 0 <= alpha <= 1:
            raise ValueError(f"VICRegLLoss alpha must be in [0, 1], got {alpha}.")
        if len(num_matches) != 2 or min(num_matches) < 1:
            raise ValueError(f"VICRegLLoss num_matches must be two counts >= 1, got "
                             f"{num_matches}.")
        self.weights = (invariance_weight, variance_weight, covariance_weight)
        self.alpha = alpha
        self.num_matches = tuple(num_matches)
        self.eps = eps

    def forward(self, embeddings: Sequence[Tensor], local_features: Sequence[Tensor],
                locations: Sequence[Tensor] | None, num_global: int = 2) -> Tensor:
        """``α·global + (1 − α)·local`` in fp32 (float64 for float64 inputs).

        Args:
            embeddings: One (B, D) global embedding per view, the ``num_global`` global views
                first, then the local crops.
            local_features: One (B, N_v, D') tensor of local features per view (its feature
                map's locations, :func:`~ssl_lightning.losses.dense_matching.map_to_locations`).
            locations: One (B, N_v, 2) tensor per view: each location's position (y, x) in the
                original image, in the same units for every view. None: no matching by
                position (the local term is then the feature-matched one alone).
            num_global: How many of the views are global.
        """
        views = len(embeddings)
        positions = [None] * views if locations is None else list(locations)
        if not (len(local_features) == len(positions) == views) or not 1 <= num_global <= views \
                or views < 2:
            raise ValueError(
                f"VICRegLLoss needs at least 2 views with one embedding, local-feature tensor and "
                f"location tensor each, and 1 <= num_global <= views; got {len(embeddings)}, "
                f"{len(local_features)}, {len(positions)} and num_global={num_global}."
            )
        for local, where in zip(local_features, positions, strict=True):
            if local.dim() != 3 or (where is not None and where.shape != (*local.shape[:2], 2)):
                shape = None if where is None else tuple(where.shape)
                raise ValueError(f"Local features (B, N, D) need locations (B, N, 2), got "
                                 f"{tuple(local.shape)} and {shape}.")
        with torch.autocast(device_type=embeddings[0].device.type, enabled=False):
            z = [at_least_fp32(e) for e in embeddings]
            maps = [at_least_fp32(f).to(z[0].dtype) for f in local_features]
            pairs = [(a, b) for a in range(num_global) for b in range(views) if b != a]
            invariance = sum(F.mse_loss(z[a], z[b]) for a, b in pairs) / len(pairs)
            variance = sum(variance_term(e, self.eps) for e in z) / views
            covariance = sum(covariance_term(e) for e in z) / views
            lam, mu, nu = self.weights
            global_term = lam * invariance + mu * variance + nu * covariance
            local_term = sum(self._local(maps[a], maps[b], positions[a], positions[b])
                             for a, b in pairs) / len(pairs)
            return self.alpha * global_term + (1 - self.alpha) * local_term

    def _local(self, za: Tensor, zb: Tensor, where_a: Tensor | None, where_b: Tensor | None
               ) -> Tensor:
        """The feature-matched plus the position-matched term of the pair (a, b)."""
        by_features = (self._matched(za, zb, pairwise_distance(za, zb, "l2"), 0)
                       + self._matched(zb, za, pairwise_distance(zb, za, "l2"), 1)) / 2
        if where_a is None or where_b is None:
            return by_features
        by_position = (self._matched(za, zb, pairwise_distance(where_a, where_b, "l2"), 0)
                       + self._matched(zb, za, pairwise_distance(where_b, where_a, "l2"), 1)) / 2
        return by_features + by_position

    def _matched(self, source: Tensor, target: Tensor, distances: Tensor, side: int) -> Tensor:
        """VICReg (ν halved) of ``source``'s best-matched locations and their partners."""
        source_index, target_index = best_matches(distances, self.num_matches[side])
        x = gather_locations(source, source_index)
        y = gather_locations(target, target_index)
        lam, mu, nu = self.weights
        return (lam * F.mse_loss(x, y)
                + mu * (variance_term(x, self.eps) + variance_term(y, self.eps)) / 2
                + nu / 2 * (covariance_term(x) + covariance_term(y)))
