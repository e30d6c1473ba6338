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

:func:`positive_cross_entropy` is the per-anchor loss ``-log softmax`` at the positive column
that NT-Xent, NNCLR and MoCo v3 share (DCL and SupCon call :func:`chunked_logsumexp` directly).
In both paths (chunked and dense) it is ``softplus(lse_neg - s_pos)`` with the log-sum-exp over
the negatives only (``exclude`` takes several columns per row for that): computing
``lse - s_pos`` instead subtracts two numbers of size ~1/T whose difference is tiny on a nearly
solved batch and loses most fp32 digits at T = 0.07. ``classes`` keeps, per row, only the
columns of the row's class or only the others (SupCon's positives and negatives) without an
(M × K) mask.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def _mask_(
    logits: Tensor, exclude: Tensor | None, classes: ClassMask | None, start: int = 0
) -> Tensor:
    """Set the left-out entries of the logit rows ``start:start + len(logits)`` to finfo.min, in
    place: the columns ``exclude[i, :]`` of row i and, with ``classes``, the columns of the other
    classes (``same``) or of the row's own class."""
    low = torch.finfo(logits.dtype).min
    if classes is not None:
        row_class = classes.rows[start:start + logits.shape[0], None]
        logits.masked_fill_((row_class == classes.columns[None, :]) != classes.same, low)
    if exclude is not None:
        logits.scatter_(1, exclude[start:start + logits.shape[0]], low)
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


class _ChunkedLogSumExp(torch.autograd.Function):
    """Row log-sum-exp of ``anchors @ candidates.T * scale``, one block of rows at a time.

    Each block is written once by a matrix product that already subtracts a per-row shift, then
    masked and exponentiated in place. The forward shift is the Cauchy-Schwarz bound
    ``scale · |a_i| · max_k |c_k|`` (no max over the block; a row far below its bound is redone
    with its exact max), the backward shift the saved log-sum-exp, which turns the recomputed
    block into the row softmax; the incoming gradient scales the (rows × D) operands of the two
    gradient products instead of the block.
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
        num_anchors = anchors.shape[0]
        rows = block_rows(chunk_size, num_anchors, candidates.shape[0], anchors.element_size())
        bound = anchors.norm(dim=1) * (candidates.norm(dim=1).max() * scale)
        left, right = _shifted_operands(anchors, candidates, scale, bound)
        block = anchors.new_empty(rows, candidates.shape[0])
        lse = anchors.new_empty(num_anchors)
        for start in range(0, num_anchors, rows):
            stop = min(start + rows, num_anchors)
            logits = _block_logits(block[: stop - start], left, right, exclude, classes, start)
            sums = logits.exp_().sum(dim=1)
            shift = bound[start:stop]
            if bool((sums < _UNDERFLOW).any()):  # rare: recompute the block with its row max
                logits = _block_logits(block[: stop - start], left, right, exclude, classes,
                                       start)
                row_max = logits.amax(dim=1, keepdim=True)
                sums = logits.sub_(row_max).exp_().sum(dim=1)
                shift = shift + row_max[:, 0]
            lse[start:stop] = sums.log_().add_(shift)
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
        block = anchors.new_empty(rows, candidates.shape[0])
        need_anchors, need_candidates = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        grad_anchors = torch.empty_like(anchors) if need_anchors else None
        grad_candidates = torch.zeros_like(candidates) if need_candidates else None
        weight = (grad_lse * scale)[:, None]
        for start in range(0, num_anchors, rows):
            stop = min(start + rows, num_anchors)
            probs = _block_logits(block[: stop - start], left, right, exclude, classes,
                                  start).exp_()  # the row softmax
            if grad_anchors is not None:
                torch.mm(probs, candidates, out=grad_anchors[start:stop])
                grad_anchors[start:stop].mul_(weight[start:stop])
            if grad_candidates is not None:  # e.g. not for detached keys (MoCo v3)
                grad_candidates.addmm_(probs.T, anchors[start:stop] * weight[start:stop])
        return grad_anchors, grad_candidates, None, None, None, None


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
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}.")
    if anchors.dim() != 2 or candidates.dim() != 2 or anchors.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"Expected (M, D) anchors and (K, D) candidates, got {tuple(anchors.shape)} and "
            f"{tuple(candidates.shape)}."
        )
    if exclude is not None:
        if exclude.dim() not in (1, 2) or exclude.shape[0] != anchors.shape[0]:
            raise ValueError(f"exclude must have shape ({anchors.shape[0]},) or "
                             f"({anchors.shape[0]}, E), got {tuple(exclude.shape)}.")
        exclude = exclude.reshape(anchors.shape[0], -1)
    with torch.autocast(device_type=anchors.device.type, enabled=False):
        a = at_least_fp32(anchors)
        c = at_least_fp32(candidates).to(a.dtype)
        if chunk_size is None:
            logits = _mask_(a @ c.T / temperature, exclude, classes)
            return torch.logsumexp(logits, dim=1)
        return _ChunkedLogSumExp.apply(  # type: ignore[no-any-return]
            a.contiguous(), c.contiguous(), exclude, classes, 1.0 / temperature, chunk_size,
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
    """Per-anchor ``-log softmax_k(s_ik)`` at the positive column, ``s_ik = a_i·c_k / T`` with
    the margin taken off the positive (``s_i,pos = (a_i·c_pos - margin) / T``), as
    ``softplus(lse_neg - s_pos)``.

    Args:
        anchors: (M, D) anchors, already L2-normalised, fp32 or float64.
        candidates: (K, D) candidates, same dtype; every anchor's positive is among them.
        positive: (M,) column of each anchor's positive.
        temperature: Softmax temperature T > 0.
        exclude: Optional (M,) or (M, E) columns left out of the denominator (the anchor itself).
        chunk_size: Rows per block of :func:`chunked_logsumexp`; ``None`` for the dense logits.
        margin: Additive margin on the positive cosine (>= 0).

    Returns:
        (M,) losses.
    """
    positive_logit = ((anchors * candidates[positive]).sum(dim=1) - margin) / temperature
    columns = positive[:, None] if exclude is None else torch.cat(
        [positive[:, None], exclude.reshape(len(positive), -1)], dim=1)
    negatives = chunked_logsumexp(anchors, candidates, temperature, columns, chunk_size)
    return F.softplus(negatives - positive_logit)


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
