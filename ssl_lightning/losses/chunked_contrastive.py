"""Memory-efficient row log-sum-exp of a contrastive logit matrix.

InfoNCE-style losses (NT-Xent of SimCLR, Chen et al., ICML 2020, Eq. 1; MoCo v3, Chen et al.,
ICCV 2021) are ``mean_i [logsumexp_k(a_i·c_k / T) - a_i·c_pos(i) / T]`` over anchors ``a`` and
candidates ``c``. The dense version materialises the (M × K) logits, their softmax and its
gradient: 3 × 4 GB in fp32 for 2 × 16384 anchors against 2 × 16384 candidates.

:func:`chunked_logsumexp` computes the log-sum-exp over blocks of ``chunk_size`` anchor rows and
keeps only the (M,) result. The backward pass recomputes each block of logits and uses the
analytic gradient of the log-sum-exp, the row softmax ``p``:
``dL/da_i = sum_k g_i p_ik c_k / T`` and ``dL/dc_k = sum_i g_i p_ik a_i / T``. Both the anchors
and the candidates receive gradients, so candidates gathered from other ranks with an
autograd-aware all-gather send their share back to the owning rank. The positive term is a row
dot product that plain autograd handles; together they give the familiar ``softmax - one_hot``.
Peak extra memory is one (chunk_size × K) block instead of several (M × K) matrices.

:func:`logsumexp_gap_mean` is the mean over the anchors of ``softplus(lse_i - s_pos_i)`` (or of
``lse_i - s_pos_i``, DCL). A row's weight in its gradient is known as soon as its block is, so
its chunked path takes both gradient products in the forward pass while the block is in cache
and recomputes nothing: three matrix products per block instead of four.

:func:`positive_cross_entropy` is its mean ``-log softmax`` at the positive column that NT-Xent,
NNCLR and MoCo v3 share (InfoNCE and DCL call :func:`logsumexp_gap_mean`, SupCon
:func:`chunked_logsumexp` directly). In both paths (chunked and dense) it is
``softplus(lse_neg - s_pos)`` with the log-sum-exp over the negatives only (``exclude`` takes
several columns per row for that): computing ``lse - s_pos`` instead subtracts two numbers of
size ~1/T whose difference is tiny on a nearly solved batch and loses most fp32 digits at
T = 0.07. ``classes`` keeps, per row, only the columns of the row's class or only the others
(SupCon's positives and negatives) without an (M × K) mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ssl_lightning.distributed import all_gather_with_grad, is_distributed, rank, world_size
from ssl_lightning.losses.numerics import at_least_fp32


class ClassMask(NamedTuple):
    """Columns a row's log-sum-exp keeps by class: those of the row's class (``same``) or the
    others."""

    rows: Tensor  # (M,) class of each anchor
    columns: Tensor  # (K,) class of each candidate
    same: bool


def _left_out(rows: int, classes: ClassMask | None, start: int) -> Tensor | None:
    """The (rows × K) mask of the other classes (``same``) or of the row's own class for the
    logit rows ``start:start + rows``; ``None`` without ``classes``."""
    if classes is None:
        return None
    row_class = classes.rows[start:start + rows, None]
    return (row_class == classes.columns[None, :]) != classes.same


def _mask_(
    logits: Tensor, exclude: Tensor | None, classes: ClassMask | None, start: int = 0,
    value: float | None = None,
) -> Tensor:
    """Set the left-out entries of the logit rows ``start:start + len(logits)`` to ``value``
    (finfo.min by default), in place: the columns ``exclude[i, :]`` of row i and, with
    ``classes``, the columns of the other classes (``same``) or of the row's own class."""
    fill = torch.finfo(logits.dtype).min if value is None else value
    left_out = _left_out(logits.shape[0], classes, start)
    if left_out is not None:
        logits.masked_fill_(left_out, fill)
    if exclude is not None:
        logits.scatter_(1, exclude[start:start + logits.shape[0]], fill)
    return logits


# Rows per block are capped so that a block of logits stays in cache (8 MiB): the mask, max, exp
# and sum then pass over cached memory instead of RAM. Fewer than MIN_BLOCK_ROWS rows make the
# matrix products themselves inefficient. Measured at 2 × 4096 × 128 fp32, one thread
# (benchmarks/loss_speed.py): 128-512 rows within 2 % of each other, 1024 rows 1.3× and 32 rows
# 1.4× slower.
BLOCK_BYTES = 8 * 2**20
MIN_BLOCK_ROWS = 128


def block_rows(chunk_size: int, num_anchors: int, num_candidates: int, itemsize: int) -> int:
    """Anchor rows per block: at most ``chunk_size`` (the memory bound the caller set) and, down
    to :data:`MIN_BLOCK_ROWS`, few enough for a (rows × K) block to fit :data:`BLOCK_BYTES`."""
    cache_rows = max(MIN_BLOCK_ROWS, BLOCK_BYTES // max(1, num_candidates * itemsize))
    return max(1, min(chunk_size, cache_rows, num_anchors))


# A block row whose sum of exp(logit - shift) is below this is recomputed with its exact max:
# the bound shift was too far above the row's largest logit for the small terms to be exact.
_UNDERFLOW = 2.0**-64


def _exp_floor(lowest: float, dtype: torch.dtype) -> float | None:
    """The clamp for shifted logits before ``exp``, or ``None`` when the ``lowest`` one can be
    is already above it: log of the smallest normal number of ``dtype``.

    On CPU, ``exp`` of an argument whose result is subnormal or zero is 20-200× slower than of
    a normal one (measured: 2M fp32 entries at -95, 69 ms against 0.4 ms at [-4, 0]), so left-out
    entries are zeroed after ``exp`` instead of set to finfo.min before it, and entries below
    the floor (T below ~0.02 on unit vectors) are clamped to it: each then adds at most
    ``tiny`` to a row sum of at least :data:`_UNDERFLOW`."""
    floor = math.log(torch.finfo(dtype).tiny)
    return floor if lowest < floor else None


def _shifted_operands(anchors: Tensor, candidates: Tensor, scale: float,
                      shift: Tensor) -> tuple[Tensor, Tensor]:
    """``[anchors * scale, -shift]`` and ``[candidates, 1]``: their product is the logit matrix
    minus ``shift`` per row, so no pass over a block subtracts it."""
    return (torch.cat([anchors * scale, -shift[:, None]], dim=1),
            torch.cat([candidates, candidates.new_ones(len(candidates), 1)], dim=1))


def _block_logits(
    out: Tensor, left: Tensor, right: Tensor, exclude: Tensor | None, classes: ClassMask | None,
    start: int,
) -> Tensor:
    """``out <- left[start:start + len(out)] @ right.T``, the shifted logits of
    :func:`_shifted_operands`, masked by :func:`_mask_`."""
    torch.mm(left[start:start + out.shape[0]], right.T, out=out)
    return _mask_(out, exclude, classes, start)


def _block_exp(
    out: Tensor, left: Tensor, right: Tensor, exclude: Tensor | None, classes: ClassMask | None,
    start: int, floor: float | None,
) -> Tensor:
    """``out <- exp(left[start:start + len(out)] @ right.T)``, clamped below at ``floor`` (see
    :func:`_exp_floor`), with the left-out entries 0."""
    torch.mm(left[start:start + out.shape[0]], right.T, out=out)
    if floor is not None:
        out.clamp_(min=floor)
    return _mask_(out.exp_(), exclude, classes, start, value=0.0)


def _norm_bound(anchors: Tensor, candidates: Tensor, scale: float) -> Tensor:
    """Per anchor, ``scale · |a_i| · max_k |c_k|``: no logit of the row is above it
    (Cauchy-Schwarz)."""
    return anchors.norm(dim=1) * (candidates.norm(dim=1).max() * scale)


RowWeight = Callable[[Tensor, slice], Tensor]


def _forward_blocks(
    anchors: Tensor, candidates: Tensor, exclude: Tensor | None, classes: ClassMask | None,
    scale: float, rows: int, row_weight: RowWeight | None = None,
    need: tuple[bool, bool] = (False, False),
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Row log-sum-exp of ``anchors @ candidates.T * scale``, one block of rows at a time, and
    with ``row_weight`` the gradient products of ``sum_i w_i lse_i`` while each block is still
    in cache: ``(lse, sum_k w_i p_ik c_k scale, sum_i w_i p_ik a_i scale)`` (``need`` says which
    of the two; ``row_weight(lse_rows, rows)`` gives ``w`` of a block from its log-sum-exp).

    Each block is written once by a matrix product that already subtracts the Cauchy-Schwarz
    bound of its row (no max over the block); a row far below its bound is redone with its
    exact max.
    """
    num_anchors = anchors.shape[0]
    bound = _norm_bound(anchors, candidates, scale)
    left, right = _shifted_operands(anchors, candidates, scale, bound)
    floor = _exp_floor(-2 * float(bound.max()), anchors.dtype) if num_anchors else None
    block = anchors.new_empty(rows, candidates.shape[0])
    lse = anchors.new_empty(num_anchors)
    grad_anchors = torch.empty_like(anchors) if need[0] else None
    grad_candidates = torch.zeros_like(candidates) if need[1] else None
    for start in range(0, num_anchors, rows):
        stop = min(start + rows, num_anchors)
        probs = _block_exp(block[: stop - start], left, right, exclude, classes, start, floor)
        sums = probs.sum(dim=1)
        shift = bound[start:stop]
        if bool((sums < _UNDERFLOW).any()):  # rare: recompute the block with its row max
            logits = _block_logits(block[: stop - start], left, right, exclude, classes,
                                   start)
            row_max = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(row_max).exp_()
            sums = probs.sum(dim=1)
            shift = shift + row_max[:, 0]
            _mask_(probs, exclude, classes, start, value=0.0)  # rows with every column out
        lse[start:stop] = sums.log().add_(shift)
        if row_weight is None:
            continue
        weight = (row_weight(lse[start:stop], slice(start, stop)) * scale / sums)[:, None]
        if grad_anchors is not None:
            torch.mm(probs, candidates, out=grad_anchors[start:stop])
            grad_anchors[start:stop].mul_(weight)
        if grad_candidates is not None:
            grad_candidates.addmm_(probs.T, anchors[start:stop] * weight)
    return lse, grad_anchors, grad_candidates


class _ChunkedLogSumExp(torch.autograd.Function):
    """Row log-sum-exp of ``anchors @ candidates.T * scale``, one block of rows at a time
    (:func:`_forward_blocks`).

    The backward pass recomputes each block with the saved log-sum-exp as the shift, which
    turns it into the row softmax; the incoming gradient scales the (rows × D) operands of the
    two gradient products instead of the block.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        anchors: Tensor,
        candidates: Tensor,
        exclude: Tensor | None,
        classes: ClassMask | None,
        scale: float,
        chunk_size: int,
    ) -> Tensor:
        rows = block_rows(chunk_size, anchors.shape[0], candidates.shape[0],
                          anchors.element_size())
        lse, _, _ = _forward_blocks(anchors, candidates, exclude, classes, scale, rows)
        ctx.save_for_backward(anchors, candidates, exclude, lse)  # type: ignore[arg-type]
        ctx.classes = classes  # type: ignore[attr-defined]
        ctx.scale = scale  # type: ignore[attr-defined]
        ctx.rows = rows  # type: ignore[attr-defined]
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_lse: Tensor):  # type: ignore[no-untyped-def,override]
        anchors, candidates, exclude, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        classes, scale, rows = ctx.classes, ctx.scale, ctx.rows  # type: ignore[attr-defined]
        num_anchors = anchors.shape[0]
        left, right = _shifted_operands(anchors, candidates, scale, lse)
        # logit - lse >= -(bound + lse): the floor is needed only if that can reach it
        lowest = -float((_norm_bound(anchors, candidates, scale) + lse).max())
        floor = _exp_floor(lowest, anchors.dtype) if num_anchors else None
        block = anchors.new_empty(rows, candidates.shape[0])
        need_anchors, need_candidates = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        grad_anchors = torch.empty_like(anchors) if need_anchors else None
        grad_candidates = torch.zeros_like(candidates) if need_candidates else None
        weight = (grad_lse * scale)[:, None]
        for start in range(0, num_anchors, rows):
            stop = min(start + rows, num_anchors)
            probs = _block_exp(block[: stop - start], left, right, exclude, classes, start,
                               floor)  # the row softmax
            if grad_anchors is not None:
                torch.mm(probs, candidates, out=grad_anchors[start:stop])
                grad_anchors[start:stop].mul_(weight[start:stop])
            if grad_candidates is not None:  # e.g. not for detached keys (MoCo v3)
                grad_candidates.addmm_(probs.T, anchors[start:stop] * weight[start:stop])
        return grad_anchors, grad_candidates, None, None, None, None


class _ChunkedGapMean(torch.autograd.Function):
    """``mean_i h(lse_i - positive_i)`` with ``h`` softplus or the identity, ``lse`` the row
    log-sum-exp of :func:`_forward_blocks`.

    The loss is a mean of per-row terms, so the weight of row i's log-sum-exp in the gradient,
    ``h'(lse_i - positive_i) / M``, is known as soon as its block is; the forward pass then
    takes the two gradient products from the block while it is in cache, and the backward pass
    only scales them by the incoming (scalar) gradient: three matrix products per block instead
    of four (two instead of three without candidate gradients), and no recomputation.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        anchors: Tensor,
        candidates: Tensor,
        positive: Tensor,
        exclude: Tensor | None,
        scale: float,
        chunk_size: int,
        softplus: bool,
        grad_enabled: bool,
    ) -> Tensor:
        num_anchors = anchors.shape[0]
        rows = block_rows(chunk_size, num_anchors, candidates.shape[0], anchors.element_size())

        def row_weight(lse: Tensor, rows_: slice) -> Tensor:
            if not softplus:
                return lse.new_full(lse.shape, 1.0 / num_anchors)
            return torch.sigmoid(lse - positive[rows_]) / num_anchors

        need = tuple(grad_enabled and bool(n) for n in ctx.needs_input_grad[:2])  # type: ignore[attr-defined]
        lse, grad_anchors, grad_candidates = _forward_blocks(
            anchors, candidates, exclude, None, scale, rows,
            row_weight if any(need) else None, need)  # type: ignore[arg-type]
        gap = lse - positive
        if softplus:
            loss, slope = F.softplus(gap).mean(), torch.sigmoid(gap)
        else:
            loss, slope = gap.mean(), torch.ones_like(gap)
        ctx.save_for_backward(grad_anchors, grad_candidates,  # type: ignore[arg-type]
                              slope / -num_anchors)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: Tensor):  # type: ignore[no-untyped-def,override]
        return (*_saved_gradients_times(ctx, grad_loss), None, None, None, None, None)


def _saved_gradients_times(ctx: FunctionCtx, grad_loss: Tensor) -> list[Tensor | None]:
    """The input gradients a forward pass computed and saved, times the loss's gradient (the
    backward of the losses whose gradients come from the forward pass)."""
    return [None if g is None else g * grad_loss
            for g in ctx.saved_tensors]  # type: ignore[attr-defined]


class _ChunkedClassGapMean(torch.autograd.Function):
    """SupCon's ``mean_i [softplus(lse_neg_i - lse_pos_i) + several_i · (lse_pos_i -
    mean_positive_i)]``, ``lse_neg`` over the columns of the other classes and ``lse_pos`` over
    those of the row's class but itself, both from one block of logits (one matrix product).

    As in :class:`_ChunkedGapMean`, both weights of a row are known once its block is, so the
    gradient products come from the block in the forward pass: three matrix products per block
    in all. A row with one of its two sums below :data:`_UNDERFLOW` (or an empty group) is redone
    with the exact log-sum-exp of each group.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        anchors: Tensor,
        candidates: Tensor,
        mean_positive: Tensor,
        several: Tensor,
        anchor_class: Tensor,
        candidate_class: Tensor,
        self_index: Tensor,
        scale: float,
        chunk_size: int,
        grad_enabled: bool,
    ) -> Tensor:
        num_anchors, num_candidates = anchors.shape[0], candidates.shape[0]
        rows = block_rows(chunk_size, num_anchors, num_candidates, anchors.element_size())
        need_anchors, need_candidates = (grad_enabled and bool(n)
                                         for n in ctx.needs_input_grad[:2])  # type: ignore[attr-defined]
        bound = _norm_bound(anchors, candidates, scale)
        left, right = _shifted_operands(anchors, candidates, scale, bound)
        floor = _exp_floor(-2 * float(bound.max()), anchors.dtype) if num_anchors else None
        block = anchors.new_empty(rows, num_candidates)
        lse_neg, lse_pos = anchors.new_empty(num_anchors), anchors.new_empty(num_anchors)
        grad_anchors = torch.empty_like(anchors) if need_anchors else None
        grad_candidates = torch.zeros_like(candidates) if need_candidates else None
        exclude = self_index[:, None]
        for start in range(0, num_anchors, rows):
            stop = min(start + rows, num_anchors)
            same = anchor_class[start:stop, None] == candidate_class[None, :]
            negatives = _block_exp(block[: stop - start], left, right, exclude, None, start,
                                   floor)
            positives = negatives * same
            pos_sums = positives.sum(dim=1)
            neg_sums = negatives.masked_fill_(same, 0.0).sum(dim=1)
            shift_neg = shift_pos = bound[start:stop]
            if bool(((pos_sums < _UNDERFLOW) | (neg_sums < _UNDERFLOW)).any()):  # rare
                logits = torch.mm(left[start:stop], right.T).add_(bound[start:stop, None])
                logits.scatter_(1, exclude[start:stop], -math.inf)
                groups = []
                for keep in (~same, same):
                    group = logits.masked_fill(~keep, -math.inf)
                    lse = torch.logsumexp(group, dim=1).clamp(min=torch.finfo(group.dtype).min)
                    groups.append((group.sub_(lse[:, None]).exp_(), lse))
                (negatives, shift_neg), (positives, shift_pos) = groups
                neg_sums, pos_sums = torch.ones_like(neg_sums), torch.ones_like(pos_sums)
            lse_neg[start:stop] = neg_sums.log().add_(shift_neg)
            lse_pos[start:stop] = pos_sums.log().add_(shift_pos)
            if not (need_anchors or need_candidates):
                continue
            slope = torch.sigmoid(lse_neg[start:stop] - lse_pos[start:stop])
            step = scale / num_anchors
            weight_neg = slope * step / neg_sums
            weight_pos = (several[start:stop].to(slope.dtype) - slope) * step / pos_sums
            probs = negatives.mul_(weight_neg[:, None])
            probs.addcmul_(positives, weight_pos[:, None])
            if grad_anchors is not None:
                torch.mm(probs, candidates, out=grad_anchors[start:stop])
            if grad_candidates is not None:
                grad_candidates.addmm_(probs.T, anchors[start:stop])
        gap = lse_neg - lse_pos
        spread = torch.where(several, lse_pos - mean_positive, 0.0)
        ctx.save_for_backward(grad_anchors, grad_candidates,  # type: ignore[arg-type]
                              several.to(anchors.dtype) / -num_anchors)
        return (F.softplus(gap) + spread).mean()

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: Tensor):  # type: ignore[no-untyped-def,override]
        return (*_saved_gradients_times(ctx, grad_loss), None, None, None, None, None, None,
                None)


def class_gap_mean(
    anchors: Tensor,
    candidates: Tensor,
    anchor_class: Tensor,
    candidate_class: Tensor,
    self_index: Tensor,
    mean_positive: Tensor,
    several: Tensor,
    temperature: float,
    chunk_size: int,
) -> Tensor:
    """SupCon's mean over the anchors of ``softplus(lse_neg - lse_pos) + several · (lse_pos -
    mean_positive)`` (``lse_neg``: the other classes, ``lse_pos``: the row's class but column
    ``self_index``), chunked (:class:`_ChunkedClassGapMean`); fp32 or float64 inputs.

    Args:
        anchors: (M, D) anchors; candidates: (K, D).
        anchor_class: (M,) class of each anchor; candidate_class: (K,) of each candidate.
        self_index: (M,) each anchor's own column, left out of both groups.
        mean_positive: (M,) each anchor's mean positive logit (divided by T).
        several: (M,) bool, the anchor has more than one positive.
        temperature: T > 0; chunk_size: anchor rows per block.
    """
    return _ChunkedClassGapMean.apply(  # type: ignore[no-any-return]
        anchors.contiguous(), candidates.contiguous(), mean_positive, several, anchor_class,
        candidate_class, self_index, 1.0 / temperature, chunk_size, torch.is_grad_enabled())


def _check_kernel_inputs(
    anchors: Tensor, candidates: Tensor, temperature: float, exclude: Tensor | None,
    chunk_size: int | None,
) -> Tensor | None:
    """``ValueError`` for bad settings or shapes; ``exclude`` as (M, E)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}.")
    if anchors.dim() != 2 or candidates.dim() != 2 or anchors.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"Expected (M, D) anchors and (K, D) candidates, got {tuple(anchors.shape)} and "
            f"{tuple(candidates.shape)}."
        )
    if exclude is None:
        return None
    if exclude.dim() not in (1, 2) or exclude.shape[0] != anchors.shape[0]:
        raise ValueError(f"exclude must have shape ({anchors.shape[0]},) or "
                         f"({anchors.shape[0]}, E), got {tuple(exclude.shape)}.")
    return exclude.reshape(anchors.shape[0], -1)


def chunked_logsumexp(
    anchors: Tensor,
    candidates: Tensor,
    temperature: float,
    exclude: Tensor | None = None,
    chunk_size: int | None = 1024,
    classes: ClassMask | None = None,
) -> Tensor:
    """``logsumexp_k(anchors_i · candidates_k / T)`` for every anchor row, over blocks of
    ``chunk_size`` rows that never hold the full (M × K) logit matrix (``None``: dense logits).

    Computes in fp32 (float64 for float64 inputs) whatever the autocast state. Gradients flow
    into both ``anchors`` and ``candidates``.

    Args:
        anchors: (M, D) anchor embeddings (usually L2-normalised).
        candidates: (K, D) candidate embeddings (positives and negatives, possibly gathered).
        temperature: Softmax temperature T > 0.
        exclude: Optional (M,) or (M, E) column indices per row left out of the sum (the anchor
            itself; for DCL also its positive).
        chunk_size: Anchor rows per block; peak extra memory is about chunk_size × K × 4 bytes.
            ``None`` builds the dense (M × K) logits and lets autograd differentiate them.
        classes: Optional class mask: each row sums only over the columns of its own class, or
            only over the others.

    Returns:
        (M,) log-sum-exp per anchor (finfo.min plus log K for a row with every column left out).
    """
    exclude = _check_kernel_inputs(anchors, candidates, temperature, exclude, chunk_size)
    with torch.autocast(device_type=anchors.device.type, enabled=False):
        a = at_least_fp32(anchors)
        c = at_least_fp32(candidates).to(a.dtype)
        if chunk_size is None:
            logits = _mask_(a @ c.T / temperature, exclude, classes)
            return torch.logsumexp(logits, dim=1)
        return _ChunkedLogSumExp.apply(  # type: ignore[no-any-return]
            a.contiguous(), c.contiguous(), exclude, classes, 1.0 / temperature, chunk_size,
        )


def logsumexp_gap_mean(
    anchors: Tensor,
    candidates: Tensor,
    positive_logit: Tensor,
    temperature: float,
    exclude: Tensor | None = None,
    chunk_size: int | None = 1024,
    softplus: bool = True,
) -> Tensor:
    """``mean_i softplus(lse_i - positive_logit_i)`` (``softplus=False``: ``mean_i (lse_i -
    positive_logit_i)``), ``lse`` as in :func:`chunked_logsumexp`.

    The chunked path takes the gradient products in the forward pass while each block is in
    cache (the weight of a row is known once its block is), so the backward pass recomputes
    nothing; ``chunk_size=None`` is the dense logits under autograd. Gradients flow into the
    anchors, the candidates and the positive logits.

    Args:
        anchors: (M, D) anchors, fp32 or float64 (at least fp32 is taken).
        candidates: (K, D) candidates.
        positive_logit: (M,) the term each row's log-sum-exp is compared with (its positive
            logit, already divided by T).
        temperature: Softmax temperature T > 0.
        exclude: Optional (M,) or (M, E) columns left out of each row's log-sum-exp.
        chunk_size: Anchor rows per block; ``None`` for the dense logits.
        softplus: ``softplus`` of the gap (the cross-entropy against the positive) or the gap
            itself (DCL).

    Returns:
        Scalar mean, in fp32 (float64 for float64 inputs) whatever the autocast state.
    """
    exclude = _check_kernel_inputs(anchors, candidates, temperature, exclude, chunk_size)
    with torch.autocast(device_type=anchors.device.type, enabled=False):
        a = at_least_fp32(anchors)
        c = at_least_fp32(candidates).to(a.dtype)
        positive_logit = positive_logit.to(a.dtype)
        if chunk_size is None:
            gap = chunked_logsumexp(a, c, temperature, exclude, None) - positive_logit
            return F.softplus(gap).mean() if softplus else gap.mean()
        return _ChunkedGapMean.apply(  # type: ignore[no-any-return]
            a.contiguous(), c.contiguous(), positive_logit, exclude, 1.0 / temperature,
            chunk_size, softplus, torch.is_grad_enabled(),
        )


def positive_cross_entropy(
    anchors: Tensor,
    candidates: Tensor,
    positive: Tensor,
    temperature: float,
    exclude: Tensor | None = None,
    chunk_size: int | None = 1024,
    margin: float = 0.0,
) -> Tensor:
    """Mean over the anchors of ``-log softmax_k(s_ik)`` at the positive column, ``s_ik =
    a_i·c_k / T`` with the margin taken off the positive (``s_i,pos = (a_i·c_pos - margin) /
    T``), as ``softplus(lse_neg - s_pos)`` (:func:`logsumexp_gap_mean`).

    Args:
        anchors: (M, D) anchors, already L2-normalised, fp32 or float64.
        candidates: (K, D) candidates, same dtype; every anchor's positive is among them.
        positive: (M,) column of each anchor's positive.
        temperature: Softmax temperature T > 0.
        exclude: Optional (M,) or (M, E) columns left out of the denominator (the anchor itself).
        chunk_size: Rows per block of the chunked kernel; ``None`` for the dense logits.
        margin: Additive margin on the positive cosine (>= 0).

    Returns:
        Scalar mean loss.
    """
    positive_logit = ((anchors * candidates[positive]).sum(dim=1) - margin) / temperature
    columns = positive[:, None] if exclude is None else torch.cat(
        [positive[:, None], exclude.reshape(len(positive), -1)], dim=1)
    return logsumexp_gap_mean(anchors, candidates, positive_logit, temperature, columns,
                              chunk_size)


def check_loss_settings(name: str, temperature: float, chunk_size: int | None) -> None:
    """``ValueError`` naming the loss ``name`` for a temperature <= 0 or a ``chunk_size`` < 1
    (``None``: dense logits)."""
    if not temperature > 0:
        raise ValueError(f"{name} temperature must be > 0, got {temperature}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{name} chunk_size must be >= 1 or None, got {chunk_size}.")


def check_rank_offset(
    rank_offset: int | None, batch: int, n_global: int, what: str = "samples",
    name: str = "The loss",
) -> int:
    """This rank's offset in the ``n_global`` gathered rows (``what`` names them in messages);
    ``ValueError`` unless its ``batch`` rows fit there.

    ``None`` means 0, except under a process group of several ranks with gathered rows beyond
    the local ones: there the offset cannot be known and a silent 0 would give a wrong loss.
    """
    if rank_offset is None:
        if n_global != batch and is_distributed():
            raise ValueError(
                f"{name} got {n_global} gathered {what} for a local batch of {batch} on rank "
                f"{rank()} of {world_size()} but no rank_offset: pass rank_offset=rank * local "
                f"batch ({rank() * batch} here), or build {name} with gather=True and pass only "
                "the local tensors."
            )
        rank_offset = 0
    if rank_offset < 0 or rank_offset + batch > n_global:
        raise ValueError(
            f"rank_offset {rank_offset} with local batch {batch} does not fit in the "
            f"{n_global} gathered {what}."
        )
    return rank_offset


def gather_local(
    name: str, tensors: Sequence[Tensor], rank_offset: int | None, gathered_given: bool = False
) -> tuple[list[Tensor], int]:
    """For a loss built with ``gather=True``: ``tensors`` concatenated over all ranks with the
    autograd-aware gather, and this rank's offset; ``ValueError`` when the caller passed gathered
    tensors (``gathered_given``) or an offset as well."""
    if gathered_given or rank_offset is not None:
        raise ValueError(f"{name} was built with gather=True and gathers itself: pass only the "
                         "local tensors, without gathered tensors or rank_offset.")
    return [all_gather_with_grad(t) for t in tensors], rank() * tensors[0].shape[0]


def check_local_and_gathered(
    name: str, local: Tensor, gathered: Tensor, rank_offset: int | None, local_what: str,
    gathered_what: str,
) -> int:
    """This rank's offset (see :func:`check_rank_offset`); ``ValueError`` unless ``local`` is
    (B, D), ``gathered`` is (N, D) and this rank's rows fit inside it (``*_what`` name the
    tensors in the message)."""
    if local.dim() != 2 or gathered.shape[1:] != local.shape[1:]:
        raise ValueError(f"{name} expects (B, D) {local_what} and (N, D) {gathered_what}, got "
                         f"{tuple(local.shape)} and {tuple(gathered.shape)}.")
    return check_rank_offset(rank_offset, local.shape[0], gathered.shape[0], gathered_what, name)


def check_two_views(
    name: str, z1: Tensor, z2: Tensor, z1_all: Tensor | None, z2_all: Tensor | None,
    rank_offset: int | None,
) -> tuple[Tensor, Tensor, int]:
    """Validate a two-view contrastive call; returns ``(z1_all, z2_all, rank_offset)`` (the
    local tensors and 0 on one process)."""
    if z1.shape != z2.shape or z1.dim() != 2:
        raise ValueError(
            f"{name} expects two (B, D) tensors of equal shape, got {tuple(z1.shape)} "
            f"and {tuple(z2.shape)}."
        )
    z1_all = z1 if z1_all is None else z1_all
    z2_all = z2 if z2_all is None else z2_all
    offset = check_rank_offset(rank_offset, z1.shape[0], z1_all.shape[0], name=name)
    return z1_all, z2_all, offset


def two_view_pairs(
    z1: Tensor, z2: Tensor, z1_all: Tensor, z2_all: Tensor, rank_offset: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The 2B local anchors and 2N gathered candidates of NT-Xent-style losses, L2-normalised
    (at least fp32), with each anchor's own column and its positive's column.

    Returns:
        ``(anchors, candidates, self_index, positive_index)``: anchors ``[z1; z2]`` (2B, D),
        candidates ``[z1_all; z2_all]`` (2N, D), and per anchor the column of itself and of the
        other view of the same sample.
    """
    batch, n_global = z1.shape[0], z1_all.shape[0]
    anchors = F.normalize(at_least_fp32(torch.cat([z1, z2])), dim=1)
    candidates = F.normalize(at_least_fp32(torch.cat([z1_all, z2_all])), dim=1)
    candidates = candidates.to(anchors.dtype)
    local = torch.arange(batch, device=z1.device) + rank_offset
    self_index = torch.cat([local, local + n_global])
    positive_index = torch.cat([local + n_global, local])
    return anchors, candidates, self_index, positive_index
