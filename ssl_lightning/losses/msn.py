"""MSN loss with a prior on the mean prediction: me-max (MSN) or a power law (PMSN).

- MSN: Assran et al., "Masked Siamese Networks for Label-Efficient Learning", ECCV 2022, §3
  (Eq. 1-2) and the official code (``src/losses.py``): each anchor view predicts
  ``p = softmax(cos(z, q) / τ)`` over K learnable prototypes q; the target is the EMA teacher's
  prediction of the unmasked view, sharpened ``p⁺ ∝ (p_teacher)^{1/T}`` and (code) balanced by
  Sinkhorn-Knopp over the global batch;
  ``ℓ = 1/(MB) Σ_{i,m} H(p⁺_i, p_{i,m}) − λ H(p̄)``, with ``p̄`` the mean prediction of all
  ``M·B`` anchors of the *global* batch. Written here as ``λ · KL(p̄ ‖ uniform) = λ (log K −
  H(p̄))`` (the code's ``+ log K``), which has the same gradient.
- PMSN: Assran et al., "The Hidden Uniform Cluster Prior in Self-Supervised Learning", ICLR
  2023, §5: the uniform prior becomes a power law, ``λ · KL(p̄ ‖ π)`` with
  ``π_k ∝ k^{−s}`` (s = 0.25); s = 0 is MSN.

Under DDP ``p̄`` is a statistic of the global batch: its sums go through the injected
``reduce_sum`` (an autograd-aware all-reduce); the cross-entropy is a mean over this rank's
anchors, so the mean of the rank losses is the single-process loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.losses.sigreg import ReduceSum
from ssl_lightning.losses.sinkhorn import sinkhorn_knopp


def power_law_prior(num_prototypes: int, exponent: float, like: Tensor) -> Tensor:
    """(K,) distribution ``π_k ∝ k^{−exponent}``, k = 1..K (exponent 0: uniform)."""
    k = torch.arange(1, num_prototypes + 1, device=like.device, dtype=like.dtype)
    weights = k.pow(-exponent)
    return weights / weights.sum()


class MSNLoss(nn.Module):
    """Cross-entropy to sharpened (Sinkhorn-balanced) teacher targets + λ·KL(p̄ ‖ prior).

    Args:
        temperature: τ > 0 of the prototype softmax (0.1).
        sharpen_temperature: T in (0, 1] of the target sharpening (0.25).
        sinkhorn_iterations: Sinkhorn-Knopp rounds on the targets (3); 0: no Sinkhorn.
        regularization_weight: λ >= 0 (1).
        power_law_exponent: s >= 0 of the prior ``π_k ∝ k^{−s}``: 0 for MSN's me-max (uniform
            prior), 0.25 for PMSN.
    """

    def __init__(self, temperature: float = 0.1, sharpen_temperature: float = 0.25,
                 sinkhorn_iterations: int = 3, regularization_weight: float = 1.0,
                 power_law_exponent: float = 0.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"MSNLoss temperature must be > 0, got {temperature}.")
        if not 0 < sharpen_temperature <= 1:
            raise ValueError(f"MSNLoss sharpen_temperature must be in (0, 1], got "
                             f"{sharpen_temperature}.")
        if sinkhorn_iterations < 0:
            raise ValueError(f"MSNLoss sinkhorn_iterations must be >= 0 (0: off), got "
                             f"{sinkhorn_iterations}.")
        if regularization_weight < 0:
            raise ValueError(f"MSNLoss regularization_weight must be >= 0, got "
                             f"{regularization_weight}.")
        if power_law_exponent < 0:
            raise ValueError(f"MSNLoss power_law_exponent must be >= 0 (0: uniform prior), got "
                             f"{power_law_exponent}.")
        self.temperature = temperature
        self.sharpen_temperature = sharpen_temperature
        self.sinkhorn_iterations = sinkhorn_iterations
        self.regularization_weight = regularization_weight
        self.power_law_exponent = power_law_exponent

    @torch.no_grad()
    def targets(self, target_logits: Tensor) -> Tensor:
        """(B, K) targets from the teacher's ``cos / τ``: ``softmax(cos / τ)^{1/T}``
        renormalised (= ``softmax(cos / (τT))``), then Sinkhorn over the global batch (the
        code's ``distributed_sinkhorn`` on the sharpened probabilities: its log is passed with
        ε = 1, so the per-prototype shift cancels and the rounds are the code's)."""
        log_sharp = F.log_softmax(target_logits / self.sharpen_temperature, dim=-1)
        if self.sinkhorn_iterations == 0:
            return log_sharp.exp()
        return sinkhorn_knopp(log_sharp, 1.0, self.sinkhorn_iterations)

    def terms(self, anchors: Tensor, targets: Tensor, prototypes: Tensor,
              reduce_sum: ReduceSum | None = None) -> tuple[Tensor, Tensor]:
        """``(cross_entropy, regularizer)`` of this rank, in fp32 (or fp64).

        Args:
            anchors: Student embeddings of the anchor views (B, M, D).
            targets: Teacher embeddings of the target view (B, D) (no gradient needed).
            prototypes: Learnable prototypes (K, D); normalised here.
            reduce_sum: Differentiable sum over ranks for ``p̄`` (identity when omitted).
        """
        if anchors.dim() != 3 or targets.dim() != 2 or anchors.shape[0] != targets.shape[0]:
            raise ValueError(f"MSNLoss expects anchors (B, M, D) and targets (B, D), got "
                             f"{tuple(anchors.shape)} and {tuple(targets.shape)}.")
        if prototypes.dim() != 2 or prototypes.shape[1] != anchors.shape[-1]:
            raise ValueError(f"MSNLoss prototypes must be (K, {anchors.shape[-1]}), got "
                             f"{tuple(prototypes.shape)}.")
        with torch.autocast(device_type=anchors.device.type, enabled=False):
            q = F.normalize(at_least_fp32(prototypes), dim=-1)
            z = F.normalize(at_least_fp32(anchors), dim=-1)
            log_p = F.log_softmax(z @ q.T / self.temperature, dim=-1)  # (B, M, K)
            with torch.no_grad():
                t = F.normalize(at_least_fp32(targets).detach().to(q.dtype), dim=-1)
                p_plus = self.targets(t @ q.T / self.temperature)  # (B, K)
            cross_entropy = -(p_plus.unsqueeze(1) * log_p).sum(-1).mean()
            probs = log_p.exp().flatten(0, 1)
            stats = torch.cat([probs.sum(0), probs.new_full((1,), probs.shape[0])])
            if reduce_sum is not None:
                stats = reduce_sum(stats)
            mean = stats[:-1] / stats[-1]
            prior = power_law_prior(mean.shape[0], self.power_law_exponent, mean)
            regularizer = (torch.xlogy(mean, mean) - mean * prior.log()).sum()
            return cross_entropy, regularizer

    def forward(self, anchors: Tensor, targets: Tensor, prototypes: Tensor,
                reduce_sum: ReduceSum | None = None) -> Tensor:
        """The loss of this rank (arguments as in :meth:`terms`)."""
        cross_entropy, regularizer = self.terms(anchors, targets, prototypes, reduce_sum)
        return cross_entropy + self.regularization_weight * regularizer
