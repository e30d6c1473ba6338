"""Stop a diverged run at the step where it diverged, on every rank, with advice.

A non-finite loss (NaN/inf) makes every later update meaningless, and left alone the run goes
on to write checkpoints of NaN weights (or dies later in an unrelated place, e.g. an SVD of
NaN embeddings). :func:`check_finite_loss` runs in :meth:`SSLMethod.training_step` before the
backward pass, so the step is never applied; :func:`check_finite_weights` runs after every
training batch and before a checkpoint is written, so neither a validation nor a checkpoint ever
sees non-finite weights and the last good checkpoint is never overwritten;
:func:`check_finite_gradients` (run by :class:`~ssl_lightning.callbacks.DivergenceCapture`
before the optimiser step) stops on a non-finite gradient before the update. The replay of a
captured step (``python -m ssl_lightning replay``) runs the step on inside :func:`guard_paused`,
to look at the backward pass of a non-finite loss.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ssl_lightning._lightning import attached_trainer, pl
from ssl_lightning.distributed.sharding import is_sharded, local_tensor

ADVICE = (
    "Try a lower learning rate (--model.lr), a longer warm-up (--model.warmup_epochs), "
    "bf16-mixed instead of 16-mixed precision (--trainer.precision bf16-mixed), or gradient "
    "clipping (--trainer.gradient_clip_val 1.0)."
)


class TrainingDivergedError(FloatingPointError):
    """The loss, a gradient or the weights became non-finite (NaN or inf), or the loss spiked.

    Attributes:
        loss: This rank's loss of the step (detached), when the loss check raised it.
        applied: The diverging update was applied (the weights check): the state before the
            step is gone.
    """

    def __init__(self, message: str, loss: Tensor | None = None, applied: bool = False) -> None:
        super().__init__(message)
        self.loss = loss
        self.applied = applied


_paused: contextvars.ContextVar[bool] = contextvars.ContextVar("guard_paused", default=False)


@contextmanager
def guard_paused() -> Iterator[None]:
    """Let :func:`check_finite_loss` pass a non-finite loss inside the block (the replay of a
    captured step runs its backward pass to find where the gradient turns non-finite)."""
    token = _paused.set(True)
    try:
        yield
    finally:
        _paused.reset(token)


def _lr(trainer: pl.Trainer) -> str:
    lrs = sorted({g["lr"] for o in trainer.optimizers for g in o.param_groups})
    return ", ".join(f"{lr:.4g}" for lr in lrs) if lrs else "unknown"


def _any_not_finite(tensors: list[Tensor], trainer: pl.Trainer | None, reduce: bool) -> bool:
    """Whether a tensor of ``tensors`` holds NaN/inf: on any rank when ``reduce`` (one scalar
    all-reduce, so every rank gets the same answer), else on this rank."""
    bad = (~torch.isfinite(torch.stack(torch._foreach_norm(tensors)))).any().float().reshape(1)
    if reduce and trainer is not None:
        bad = trainer.strategy.reduce(bad, reduce_op="sum")
    return bad.item() != 0


def _step(trainer: pl.Trainer | None, preposition: str) -> str:
    """`` at/after global step G (epoch E, learning rate L)`` for an error line ("" unattached)."""
    return "" if trainer is None else (
        f" {preposition} global step {trainer.global_step} (epoch {trainer.current_epoch}, "
        f"learning rate {_lr(trainer)})"
    )


def check_finite_loss(module: pl.LightningModule, loss: Tensor, batch_idx: int) -> None:
    """Raise :class:`TrainingDivergedError` on every rank when the loss of any rank is not finite.

    Costs one scalar all-reduce and one host synchronisation per step under DDP (the flag is
    reduced so that all ranks stop at the same step, never leaving one rank in a collective).
    """
    if _paused.get():
        return
    bad = (~torch.isfinite(loss.detach())).sum().float().reshape(1)
    trainer = attached_trainer(module)
    if trainer is not None:
        bad = trainer.strategy.reduce(bad, reduce_op="sum")
    ranks = int(bad.item())
    if ranks == 0:
        return
    where = "" if trainer is None else (
        f" at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch "
        f"{batch_idx}) with learning rate {_lr(trainer)}"
    )
    what = f"{loss.item()}"
    if trainer is not None and trainer.world_size > 1:
        what = (f"not finite on {ranks} of {trainer.world_size} ranks (rank "
                f"{trainer.global_rank}: {what})")
    raise TrainingDivergedError(
        f"Training diverged: the loss is {what}{where}. The step was not "
        f"applied and no checkpoint was written from it. {ADVICE}", loss=loss.detach()
    )


def check_finite_gradients(module: pl.LightningModule) -> None:
    """Raise :class:`TrainingDivergedError` on every rank when a gradient of any rank holds
    NaN/inf (before the optimiser step, so the update is never applied; one scalar all-reduce).
    Not for 16-mixed precision, whose gradient scaler skips such steps by design."""
    grads = [local_tensor(p.grad.detach()) for p in module.parameters() if p.grad is not None]
    trainer = attached_trainer(module)
    if not grads or not _any_not_finite(grads, trainer, reduce=True):
        return
    raise TrainingDivergedError(
        f"Training diverged: a gradient is not finite (NaN/inf){_step(trainer, 'at')}, "
        "although the loss was finite. The step was not applied and no checkpoint was written "
        f"from it. {ADVICE}"
    )


def check_finite_weights(module: pl.LightningModule, reduce: bool = True) -> None:
    """Raise :class:`TrainingDivergedError` on every rank when a parameter holds NaN/inf.

    Runs after every training batch (so no validation or checkpoint sees diverged weights: a
    finite loss can still produce an infinite update) and before every checkpoint save.
    ``reduce``: combine the flag over ranks (one scalar all-reduce); without it the check is
    local, which is consistent under DDP, where every rank holds the same parameters; sharded
    parameters (FSDP2) are checked on this rank's shards and always reduced.
    """
    params = [p.detach() for p in module.parameters() if p.is_floating_point()]
    if not params:
        return
    reduce = reduce or any(is_sharded(p) for p in params)
    trainer = attached_trainer(module)
    if not _any_not_finite([local_tensor(p) for p in params], trainer, reduce):
        return
    raise TrainingDivergedError(
        f"Training diverged: the weights are not finite (NaN/inf){_step(trainer, 'after')}, "
        "although the loss was finite: an update overflowed. The run stops before any "
        f"validation or checkpoint sees them (the last checkpoint written is kept). {ADVICE}",
        applied=True
    )


__all__ = ["TrainingDivergedError", "check_finite_gradients", "check_finite_loss",
           "check_finite_weights", "guard_paused"]
