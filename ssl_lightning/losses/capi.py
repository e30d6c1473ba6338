"""The CAPI loss: a student predicts the online clusters of the teacher's masked patches.

Darcet, Baldassarre, Oquab, Mairal & Bojanowski, "Cluster and Predict Latent Patches for
Improved Masked Image Modeling", arXiv 2502.08769, 2025, §3.2. The teacher's patch tokens
``t`` (B, N, D) are L2-normalised and scored against the clustering layer (a linear layer of K
prototypes with a bias), ``l = W t̂ + b``. The targets are the Sinkhorn-Knopp codes of
``l / τ_t`` balanced over the batch separately at every position (positionwise, 3 iterations,
τ_t = 0.06). Two cross-entropies use them:

- the CAPI loss, ``−Σ_k q_k log softmax(s / τ_s)_k`` averaged over the predicted patches, where
  ``s`` (B, P, K) are the student's logits at the predicted positions (τ_s = 0.12);
- the clustering loss, the same cross-entropy between the codes and the teacher's own logits
  ``l / τ_p`` (τ_p = 0.12) over all patches: it trains the prototypes (the teacher's tokens
  carry no gradient) and the codes carry no gradient to either.

The two terms reach disjoint parameters, so their sum trains both as the official code's two
optimisers do. Every rank's Sinkhorn sums run over the global batch
(:func:`~ssl_lightning.losses.sinkhorn.sinkhorn_knopp`). lightly's ``CAPILoss`` computes each
term (the second with the teacher logits as ``student_logits``); its Sinkhorn, like the official
one, adds 1e-8 to the denominators, which this one does not: the codes differ where a cluster
gets almost no mass at a position, and agree to 1e-7 on logits within a few units of τ_t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.sinkhorn import sinkhorn_knopp


class CAPILoss(nn.Module):
    """CAPI's prediction and clustering cross-entropies.

    Args:
        target_temperature: τ_t of the Sinkhorn codes (0.06).
        student_temperature: τ_s of the student's logits (0.12).
        clustering_temperature: τ_p of the teacher's logits in the clustering loss (0.12).
        sinkhorn_iterations: Sinkhorn-Knopp rounds (3).
    """

    def __init__(self, target_temperature: float = 0.06, student_temperature: float = 0.12,
                 clustering_temperature: float = 0.12, sinkhorn_iterations: int = 3) -> None:
        super().__init__()
        for name, value in (("target_temperature", target_temperature),
                            ("student_temperature", student_temperature),
                            ("clustering_temperature", clustering_temperature)):
            if not value > 0:
                raise ValueError(f"CAPI {name} must be > 0, got {value}.")
        if sinkhorn_iterations < 1:
            raise ValueError(f"CAPI sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}.")
        self.target_temperature = target_temperature
        self.student_temperature = student_temperature
        self.clustering_temperature = clustering_temperature
        self.sinkhorn_iterations = sinkhorn_iterations

    def targets(self, teacher_logits: Tensor) -> Tensor:
        """The positionwise Sinkhorn codes (B, N, K) of ``teacher_logits`` (B, N, K), no grad."""
        codes = sinkhorn_knopp(teacher_logits.detach().transpose(0, 1), self.target_temperature,
                               self.sinkhorn_iterations)
        return codes.transpose(0, 1)

    @staticmethod
    def cross_entropy(targets: Tensor, logits: Tensor, temperature: float) -> Tensor:
        """Mean over tokens of ``−Σ_k targets_k log softmax(logits / temperature)_k``."""
        log_p = F.log_softmax(at_least_fp32(logits) / temperature, dim=-1)
        return -(targets * log_p).sum(dim=-1).mean()

    def forward(self, student_logits: Tensor, teacher_logits: Tensor,
                predict_index: Tensor) -> tuple[Tensor, Tensor]:
        """``(capi, clustering)`` losses of the local batch, in fp32 even under autocast.

        Args:
            student_logits: The student's logits (B, P, K) at the predicted patches.
            teacher_logits: The clustering layer's logits (B, N, K) of all teacher patches.
            predict_index: Row-major patch indices (B, P) of the predicted patches.
        """
        if student_logits.shape[:2] != predict_index.shape or student_logits.dim() != 3:
            raise ValueError(f"student_logits {tuple(student_logits.shape)} must be (B, P, K) "
                             f"for predict_index {tuple(predict_index.shape)}.")
        if teacher_logits.dim() != 3 or teacher_logits.shape[0] != student_logits.shape[0] \
                or teacher_logits.shape[-1] != student_logits.shape[-1]:
            raise ValueError(f"teacher_logits {tuple(teacher_logits.shape)} must be (B, N, K) "
                             f"with the B and K of student_logits {tuple(student_logits.shape)}.")
        with torch.autocast(device_type=teacher_logits.device.type, enabled=False):
            codes = self.targets(teacher_logits)
            picked = codes.gather(1, predict_index.unsqueeze(-1).expand(-1, -1, codes.shape[-1]))
            capi = self.cross_entropy(picked, student_logits, self.student_temperature)
            clustering = self.cross_entropy(codes, teacher_logits, self.clustering_temperature)
        return capi, clustering
