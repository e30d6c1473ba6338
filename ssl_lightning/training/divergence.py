"""Stop a diverged run at the step where it diverged, on every rank, with advice.

A non-finite loss (NaN/inf) makes every later update meaningless, and left alone the run goes
on to write checkpoints of NaN weights (or dies later in an unrelated place, e.g. an SVD of
NaN embeddings). :func:`check_finite_loss` runs in :meth:`SSLMethod.training_step` before the
backward pass, so the step is never applied; :func:`check_finite_weights` runs after every
training batch and before a checkpoint is written, so neither a validation nor a checkpoint ever
sees non-finite weights and the last good checkpoint is never overwritten.
"""

from __future__ import annotations

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
    """The loss or the weights became non-finite (NaN or inf)."""


def _lr(trainer: pl.Trainer) -> str:
    lrs = sorted({g["lr"] for o in trainer.optimizers for g in o.param_groups})
    return ", ".join(f"{lr:.4g}" for lr in lrs) if lrs else "unknown"


def check_finite_loss(module: pl.LightningModule, loss: Tensor, batch_idx: int) -> None:
    """Raise :class:`TrainingDivergedError` on every rank when the loss of any rank is not finite.

    Costs one scalar all-reduce and one host synchronisation per step under DDP (the flag is
    reduced so that all ranks stop at the same step, never leaving one rank in a collective).
    """
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
        f"applied and no checkpoint was written from it. {ADVICE}"
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
    params = [local_tensor(p) for p in params]
    bad = (~torch.isfinite(torch.stack(torch._foreach_norm(params)))).any().float().reshape(1)
    trainer = attached_trainer(module)
    if reduce and trainer is not None:
        bad = trainer.strategy.reduce(bad, reduce_op="sum")
    if bad.item() == 0:
        return
    step = "" if trainer is None else (
        f" after global step {trainer.global_step} (epoch {trainer.current_epoch}, learning "
        f"rate {_lr(trainer)})"
    )
    raise TrainingDivergedError(
        f"Training diverged: the weights are not finite (NaN/inf){step}, although the loss "
        "was finite: an update overflowed. The run stops before any validation or checkpoint "
        f"sees them (the last checkpoint written is kept). {ADVICE}"
    )


__all__ = ["TrainingDivergedError", "check_finite_loss", "check_finite_weights"]
