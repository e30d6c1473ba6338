"""Gradient caching: the exact loss and gradients of a large batch with the memory of a micro-batch.

Gao, Zhang, Han & Callan, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup", RepL4NLP 2021. Any module that implements ``forward_views`` (the networks, per-sample
outputs) and ``loss_from_outputs`` (gathers, the loss, state updates), as every
:class:`~ssl_lightning.methods.SSLMethod` does, gets it through ``micro_batch_size``:

1. pass 1: every micro-batch through ``forward_views`` without autograd (the first one with
   autograd, only to learn which outputs need a gradient), saving the random state before each;
2. the loss of the whole batch on the concatenated outputs, exactly as without micro-batching,
   and its gradient with respect to those outputs (and to any parameter the loss itself uses);
3. pass 2: every micro-batch again with autograd, from the same random state and buffers, and
   the backward of the cached output gradients.

Masks and stochastic depth drawn per sample (the batch's keys, split with the samples, see
:mod:`~ssl_lightning.training.sample_rng`) are those of the whole batch in every pass. Batches
without sample seeds draw from torch's generator: a method's per-batch decisions (masks, their
stratified ratios) go through :func:`whole_batch_draw`, which draws them once for the whole
batch, from the random state the whole batch's forward starts from, and hands each micro-batch
its rows; the saved random state is replayed for the rest (dropout).

The parameter gradients of all but the last micro-batch are summed with ``torch.autograd.grad``
(no ``.grad`` writes, so no DDP hook fires and Lightning's ``zero_grad`` between
``training_step`` and backward loses nothing). The returned surrogate has the value of the loss;
its backward sends the cached gradients into the last micro-batch's graph and the summed ones
into the parameters, so the one backward Lightning runs (loss scaling, DDP all-reduce,
``on_after_backward``, clipping) sees the complete gradient.

Buffers are restored after pass 1, so BatchNorm running statistics are updated once per
micro-batch (by pass 2), as with plain per-micro-batch training; BatchNorm batch statistics are
per micro-batch (see docs/gradient_caching.md).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward

T = TypeVar("T")


@dataclass
class _MicroBatch:
    """The rows ``[start, stop)`` of a whole batch of ``size`` that gradient caching is running
    without sample keys, and the whole batch's draws (by name) of this step."""

    start: int
    stop: int
    size: int
    draws: dict[str, Any] = field(default_factory=dict)


_MICRO_BATCH: contextvars.ContextVar[_MicroBatch | None] = contextvars.ContextVar(
    "micro_batch", default=None)


@contextmanager
def _running(micro_batch: _MicroBatch | None) -> Iterator[None]:
    token = _MICRO_BATCH.set(micro_batch)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def whole_batch_draw(name: str, batch: int, draw: Callable[[int], T]) -> T:
    """``draw(batch)``: random decisions of ``batch`` samples (tensors, or a tuple of tensors,
    with the samples in dim 0), drawn once for the whole batch under gradient caching.

    Outside a micro-batch of :func:`grad_cached_loss` run without sample keys this is
    ``draw(batch)``. Inside, the first micro-batch draws for the whole batch (from the random
    state the whole batch's forward starts from, so the draws are the whole batch's) and keeps
    them under ``name``; every micro-batch returns its own rows. Call it before anything else in
    ``forward_views`` draws from torch's generator.
    """
    micro = _MICRO_BATCH.get()
    if micro is None:
        return draw(batch)
    if micro.start == 0:
        micro.draws[name] = draw(micro.size)
    whole = micro.draws[name]
    if isinstance(whole, tuple):
        return type(whole)(t[micro.start:micro.stop] for t in whole)  # type: ignore[return-value]
    return whole[micro.start:micro.stop]


class SplitStep(Protocol):
    """What gradient caching uses of a method: the step split into networks and loss."""

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]: ...

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]: ...

    def get_buffer(self, target: str) -> Tensor: ...


def add_step_inputs(method: Any, outputs: dict[str, Any]) -> None:
    """Join the whole batch's targets and sample seeds (when set for this step) to the
    outputs as ``"targets"`` and ``"sample_seeds"`` (training_loss and gradient caching)."""
    for key, value in (("targets", getattr(method, "_step_targets", None)),
                       ("sample_seeds", getattr(method, "_step_seeds", None))):
        if value is not None:
            outputs.setdefault(key, value)


def check_micro_batch_size(micro_batch_size: int, batch_size: int) -> None:
    """Raise a ``ValueError`` unless ``micro_batch_size`` divides the per-device ``batch_size``."""
    if micro_batch_size <= 0 or batch_size % micro_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must be > 0 and divide the per-device batch "
            f"size {batch_size}; choose a divisor of {batch_size} or change the batch size."
        )


def grad_cached_loss(
    method: SplitStep,
    views: Sequence[Tensor],
    micro_batch_size: int,
    loss_scale: Tensor | float = 1.0,
    keys: SampleKeys | None = None,
) -> tuple[Tensor, Tensor]:
    """``method``'s training loss of the whole batch with micro-batched networks.

    Args:
        method: Implements ``forward_views`` and ``loss_from_outputs``.
        views: View tensors with the batch in dim 0 (a smaller last micro-batch is allowed).
        micro_batch_size: Samples per micro-batch.
        loss_scale: The factor the caller's backward multiplies the returned loss by (Lightning:
            ``GradScaler`` scale / ``accumulate_grad_batches``); the cached gradients are
            computed at this scale, like the gradients of an ordinary backward.
        keys: The batch's per-sample keys, split with the samples: each micro-batch draws the
            masks and stochastic depth of its own samples, as the whole batch would
            (:mod:`~ssl_lightning.training.sample_rng`).

    Returns:
        ``(loss, features)``: a scalar equal to the whole-batch loss whose ``backward()`` leaves
        the whole-batch parameter gradients, and the first view's backbone features (detached).
    """
    chunks = [list(c) for c in zip(*(v.split(micro_batch_size) for v in views), strict=True)]
    chunk_keys = keys.split(micro_batch_size) if keys is not None else [None] * len(chunks)
    whole_size = len(views[0])
    starts = list(range(0, whole_size, micro_batch_size))
    whole_draws: dict[str, Any] = {}
    rows = [None if keys is not None else
            _MicroBatch(start, min(start + micro_batch_size, whole_size), whole_size, whole_draws)
            for start in starts]
    device = views[0].device
    params = [p for p in method.parameters() if p.requires_grad]
    saved_buffers = {name: b.detach().clone() for name, b in method.named_buffers()}

    # Pass 1: outputs of every micro-batch, without autograd.
    rng_states, cached, needs_grad = [], [], []
    structure: list[tuple[str, int | None]] = []
    for i, chunk in enumerate(chunks):
        rng_states.append(_rng_state(device))
        with torch.set_grad_enabled(i == 0), keyed_forward(chunk_keys[i]), _running(rows[i]):
            leaves, structure = _flatten(method.forward_views(chunk))  # i == 0: which need grad
        if i == 0:
            needs_grad = [isinstance(t, Tensor) and t.requires_grad for t in leaves]
        cached.append([t.detach() if isinstance(t, Tensor) else t for t in leaves])
        del leaves  # frees the first micro-batch's graph before the next forward
    _restore_buffers(method, saved_buffers)
    end_rng = _rng_state(device)

    # The whole-batch loss and its gradients w.r.t. the cached outputs (and the loss's own
    # parameters, if any).
    whole = [_concat([c[j] for c in cached]) for j in range(len(needs_grad))]
    grad_leaves = [j for j, need in enumerate(needs_grad) if need]
    for j in grad_leaves:
        whole[j].requires_grad_(True)
    outputs = _unflatten(whole, structure)
    add_step_inputs(method, outputs)  # the whole batch's targets and seeds, as training_loss
    loss = method.loss_from_outputs(outputs)
    grads = torch.autograd.grad(loss * loss_scale, [whole[j] for j in grad_leaves] + params,
                                allow_unused=True)
    sizes = [len(chunk[0]) for chunk in chunks]
    leaf_grads = {j: g.split(sizes) for j, g in zip(grad_leaves, grads, strict=False)
                  if g is not None}
    summed: list[Tensor | None] = list(grads[len(grad_leaves):])

    # Pass 2: each micro-batch with autograd, from pass 1's random state.
    last_outputs: list[Tensor] = []
    last_grads: list[Tensor] = []
    for i, chunk in enumerate(chunks):
        _set_rng_state(device, rng_states[i])
        with keyed_forward(chunk_keys[i]), _running(rows[i]):
            leaves, _ = _flatten(method.forward_views(chunk))
        pairs = [(leaves[j], g[i]) for j, g in leaf_grads.items() if leaves[j].requires_grad]
        if i == len(chunks) - 1:
            last_outputs, last_grads = [o for o, _ in pairs], [g for _, g in pairs]
        elif pairs:
            step = torch.autograd.grad([o for o, _ in pairs], params,
                                       grad_outputs=[g for _, g in pairs], allow_unused=True)
            summed = [_add(a, b) for a, b in zip(summed, step, strict=True)]
    _set_rng_state(device, end_rng)

    used = [(p, g) for p, g in zip(params, summed, strict=True) if g is not None]
    surrogate = _CachedBackward.apply(
        loss.detach(), loss_scale, tuple(last_grads) + tuple(g for _, g in used),
        *last_outputs, *(p for p, _ in used),
    )
    features = _concat([c[_position(structure, "features")] for c in cached])
    return surrogate, features


class _CachedBackward(torch.autograd.Function):
    """Value: the loss; backward: the cached gradients (at ``loss_scale``) into its inputs."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, loss_scale: Tensor | float, grads: tuple[Tensor, ...],
                *inputs: Tensor) -> Tensor:
        ctx.loss_scale, ctx.grads = loss_scale, grads
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        factor = grad_output / ctx.loss_scale  # exactly 1 when the caller scaled as announced
        return (None, None, None, *(g * factor.to(g.dtype) for g in ctx.grads))


def _position(structure: list[tuple[str, int | None]], key: str) -> int:
    """Position of the (single-tensor) output ``key`` among the flattened leaves."""
    for position, (name, index) in enumerate(structure):
        if name == key and index is None:
            return position
    raise ValueError(f"forward_views must return a {key!r} tensor (backbone features of the "
                     "first view), got keys " + str(sorted({n for n, _ in structure})) + ".")


def _flatten(outputs: dict[str, Any]) -> tuple[list[Any], list[tuple[str, int | None]]]:
    """Leaves of a ``{key: value or list of values}`` dict, and where each came from."""
    if not isinstance(outputs, dict):
        raise TypeError(f"forward_views must return a dict, got {type(outputs).__name__}.")
    leaves: list[Any] = []
    structure: list[tuple[str, int | None]] = []
    for key, value in outputs.items():
        if isinstance(value, (list, tuple)):
            leaves += list(value)
            structure += [(key, i) for i in range(len(value))]
        else:
            leaves.append(value)
            structure.append((key, None))
    return leaves, structure


def _unflatten(leaves: list[Any], structure: list[tuple[str, int | None]]) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    for leaf, (key, index) in zip(leaves, structure, strict=True):
        if index is None:
            outputs[key] = leaf
        else:
            outputs.setdefault(key, []).append(leaf)
    return outputs


def _concat(values: list[Any]) -> Any:
    """Concatenate per-micro-batch tensors along the batch dim; other values must agree."""
    if isinstance(values[0], Tensor):
        if values[0].dim() == 0:
            raise ValueError("forward_views outputs need the batch in dim 0; got a 0-d tensor.")
        return torch.cat(values)
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"A non-tensor output of forward_views differs between micro-batches: "
                         f"{values[0]!r} vs {values[1:]!r}.")
    return values[0]


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def _restore_buffers(method: SplitStep, saved: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, value in saved.items():
            method.get_buffer(name).copy_(value)


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
