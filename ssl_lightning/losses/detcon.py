"""DetCon's loss: a contrastive loss between mask-pooled features of image segments.

Hénaff, Koppula, Alayrac, van den Oord, Vinyals & Carreira, "Efficient Visual Pretraining with
Contrastive Detection", ICCV 2021, §3 (Eq. 1-2): the feature map of each view is average-pooled
under each segment mask (:func:`mask_pool`) and projected, giving one vector per (image, mask);
for a segment m of view a of image i, the positive is the same segment of view b of the same
image, the negatives are every segment of view b of every image of the global batch and the
other segments of view a of the same image and of the other images:

``ℓ(m) = −log exp(v_m·v'_m / τ) / Σ_{n ∈ negatives ∪ {m'}} exp(v_m·v_n / τ)``,

on L2-normalised vectors. DetCon-S (SimCLR form) contrasts the projections with themselves;
DetCon-B (BYOL form) contrasts the online predictions with the momentum teacher's projections.

Segments are named by integer ids per (image, slot), (B, M). Slots of one image with equal ids
are the same segment; an id < 0 marks a slot whose segment does not appear in that view: such a
slot is neither an anchor, a positive nor a negative. A slot's term is divided by the number of
slots of its view sharing its id, and averaged over all B·M slots; the two directions (a→b and
b→a) are summed. With every id >= 0 this is lightly's ``DetConBLoss`` (and ``DetConSLoss`` with
the targets equal to the predictions) exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.losses.numerics import at_least_fp32


def mask_pool(locations: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Average the N locations (B, N, C) of a feature map under K soft segment masks (B, N, K)
    (each location's share of each segment): the pooled features (B, K, C) and the slots' ids
    (B, K): k for segment k, −1 where the segment has no area in this view (it pools to 0)."""
    if locations.dim() != 3 or weights.dim() != 3 or weights.shape[:2] != locations.shape[:2]:
        raise ValueError(f"Expected locations (B, N, C) and mask weights (B, N, K), got "
                         f"{tuple(locations.shape)} and {tuple(weights.shape)}.")
    weights = weights.to(locations.dtype)
    area = weights.sum(dim=1)
    pooled = weights.transpose(1, 2) @ locations
    ids = torch.arange(weights.shape[2], device=weights.device).expand(len(weights), -1)
    return (pooled / area.clamp_min(torch.finfo(area.dtype).tiny).unsqueeze(2),
            torch.where(area > 0, ids, -1))


class DetConLoss(nn.Module):
    """DetCon's contrastive loss over segments (module docstring).

    Args:
        temperature: τ (0.1 in the paper).
    """

    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"DetConLoss temperature must be > 0, got {temperature}.")
        self.temperature = temperature

    def _direction(self, pred: Tensor, ids: Tensor, other: Tensor, other_ids: Tensor,
                   same: Tensor, same_ids: Tensor, offset: int) -> Tensor:
        """Summed terms of the anchors ``pred`` (B, M, D) of view a against the gathered targets
        of view b (``other``) and of view a (``same``), (G, M, D), with their ids."""
        batch, slots = ids.shape
        own = torch.arange(batch, device=ids.device) + offset
        is_own = torch.zeros(batch, other.shape[0], dtype=torch.bool, device=ids.device)
        is_own[torch.arange(batch, device=ids.device), own] = True
        # (B, M, G, M): same image and same segment id
        positive = is_own[:, None, :, None] & (ids[:, :, None, None] == other_ids[None, None])
        positive &= (ids >= 0)[:, :, None, None]
        same_segment = is_own[:, None, :, None] & (ids[:, :, None, None] == same_ids[None, None])
        logits_b = torch.einsum("bmd,gnd->bmgn", pred, other) / self.temperature
        logits_a = torch.einsum("bmd,gnd->bmgn", pred, same) / self.temperature
        excluded = torch.finfo(logits_b.dtype).min  # exp(.) is exactly 0, and never NaN
        logits_b = logits_b.masked_fill((other_ids < 0)[None, None], excluded)
        logits_a = logits_a.masked_fill(same_segment | (same_ids < 0)[None, None], excluded)
        logits = torch.cat([logits_b, logits_a], dim=2).flatten(2)
        log_prob = torch.log_softmax(logits, dim=2)[..., :positive[0, 0].numel()]
        positive = positive.flatten(2)
        count = positive.sum(dim=2)
        term = -torch.where(positive, log_prob, 0.0).sum(dim=2) / count.clamp_min(1)
        share = (ids[:, :, None] == ids[:, None, :]).sum(dim=2)  # slots with the same id
        return torch.where(count > 0, term / share, 0.0).sum()

    def forward(self, pred1: Tensor, pred2: Tensor, target1: Tensor, target2: Tensor,
                ids1: Tensor, ids2: Tensor, target_ids1: Tensor, target_ids2: Tensor,
                offset: int = 0) -> Tensor:
        """The loss of this rank's anchors.

        Args:
            pred1, pred2: The anchors of views 1 and 2, (B, M, D).
            target1, target2: The targets of views 1 and 2 of the global batch, (G, M, D)
                (the gathered predictions for DetCon-S, the teacher's projections for DetCon-B).
            ids1, ids2: Segment ids of the anchors' slots, (B, M) integers (< 0: absent).
            target_ids1, target_ids2: Segment ids of the targets' slots, (G, M).
            offset: Index of this rank's first image in the global batch.
        """
        if pred1.dim() != 3 or pred1.shape != pred2.shape or ids1.shape != pred1.shape[:2] \
                or ids2.shape != ids1.shape or target1.shape != target2.shape \
                or target_ids1.shape != target1.shape[:2] or target_ids2.shape != target_ids1.shape:
            raise ValueError(
                f"DetConLoss expects anchors (B, M, D) with ids (B, M) and targets (G, M, D) with "
                f"ids (G, M); got {tuple(pred1.shape)}, {tuple(pred2.shape)}, ids "
                f"{tuple(ids1.shape)}, {tuple(ids2.shape)}, targets {tuple(target1.shape)}, "
                f"{tuple(target2.shape)}, ids {tuple(target_ids1.shape)}, "
                f"{tuple(target_ids2.shape)}.")
        with torch.autocast(device_type=pred1.device.type, enabled=False):
            p1, p2, t1, t2 = (F.normalize(at_least_fp32(x), dim=2)
                              for x in (pred1, pred2, target1, target2))
            total = self._direction(p1, ids1, t2, target_ids2, t1, target_ids1, offset) \
                + self._direction(p2, ids2, t1, target_ids1, t2, target_ids2, offset)
            return total / ids1.numel()
