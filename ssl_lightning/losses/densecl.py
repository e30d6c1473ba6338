"""DenseCL loss: MoCo's InfoNCE on global embeddings plus a dense InfoNCE between locations.

Wang, Zhang, Shen, Kong & Li, "Dense Contrastive Learning for Self-Supervised Visual
Pre-Training", CVPR 2021, Eqs. (1)-(3):

- global: ``L_q = −log exp(q·k+/τ) / (exp(q·k+/τ) + Σ_k− exp(q·k−/τ))`` (MoCo v2), the
  negatives a queue of global keys;
- dense: for every location r of the query view's dense projection, the positive is the key
  view's dense projection at the location whose *backbone* feature is most similar (cosine) to
  the query's backbone feature at r
  (:func:`~ssl_lightning.losses.dense_matching.nearest_locations`);
  the negatives are a second queue, of the key view's dense projections averaged over locations
  (the authors' code, ``queue2``); ``L_r`` is the InfoNCE of every location, averaged over the
  B·S² locations;
- ``L = (1 − λ)·L_q + λ·L_r`` with λ = 0.5.

Every term is per query sample and both queues are the same on every rank, so under DDP each
rank's loss is the mean over its own samples and no gradient crosses ranks.
"""

from __future__ import annotations

from torch import Tensor, nn

from ssl_lightning.losses.dense_matching import gather_locations, nearest_locations
from ssl_lightning.losses.infonce import InfoNCELoss


class DenseCLLoss(nn.Module):
    """DenseCL's weighted sum of a global and a dense InfoNCE.

    Args:
        temperature: τ of both InfoNCE terms (0.2 in DenseCL).
        dense_weight: λ, the weight of the dense term; the global one gets 1 − λ (0.5).
    """

    def __init__(self, temperature: float = 0.2, dense_weight: float = 0.5) -> None:
        super().__init__()
        if not 0 <= dense_weight <= 1:
            raise ValueError(f"DenseCLLoss dense_weight must be in [0, 1], got {dense_weight}.")
        self.infonce = InfoNCELoss(temperature)
        self.dense_weight = dense_weight

    def terms(self, query: Tensor, key: Tensor, negatives: Tensor, query_dense: Tensor,
              key_dense: Tensor, query_backbone: Tensor, key_backbone: Tensor,
              dense_negatives: Tensor) -> tuple[Tensor, Tensor]:
        """The unweighted ``(global, dense)`` InfoNCE terms.

        Args:
            query: Global queries (B, D); gradients flow through them.
            key: Global keys (B, D) of the other view (detached).
            negatives: The global queue (K, D).
            query_dense: Dense queries (B, N, D), one per location of the query view.
            key_dense: Dense keys (B, M, D) of the key view (detached).
            query_backbone: Backbone features (B, N, C) of the query view's locations, which
                choose the positives (no gradient).
            key_backbone: Backbone features (B, M, C) of the key view's locations.
            dense_negatives: The dense queue (K2, D).
        """
        if query_dense.dim() != 3 or query_dense.shape[:2] != query_backbone.shape[:2] \
                or key_dense.shape[:2] != key_backbone.shape[:2] or len(query_dense) != len(query):
            raise ValueError(
                "DenseCLLoss expects dense queries (B, N, D) with backbone features (B, N, C) "
                "and dense keys (B, M, D) with backbone features (B, M, C), got "
                f"{tuple(query_dense.shape)}, {tuple(query_backbone.shape)}, "
                f"{tuple(key_dense.shape)} and {tuple(key_backbone.shape)}."
            )
        positives = gather_locations(key_dense, nearest_locations(query_backbone, key_backbone))
        dense = self.infonce(query_dense.flatten(0, 1), positives.flatten(0, 1), dense_negatives)
        return self.infonce(query, key, negatives), dense

    def combine(self, global_term: Tensor, dense_term: Tensor) -> Tensor:
        """``(1 − λ)·global + λ·dense`` from the output of :meth:`terms`."""
        return (1 - self.dense_weight) * global_term + self.dense_weight * dense_term

    def forward(self, query: Tensor, key: Tensor, negatives: Tensor, query_dense: Tensor,
                key_dense: Tensor, query_backbone: Tensor, key_backbone: Tensor,
                dense_negatives: Tensor) -> Tensor:
        """The DenseCL loss (arguments as in :meth:`terms`), in fp32 (float64 for float64)."""
        return self.combine(*self.terms(query, key, negatives, query_dense, key_dense,
                                        query_backbone, key_backbone, dense_negatives))

