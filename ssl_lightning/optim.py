"""Optimisers and schedules for SSL pre-training.

- LARS: You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks", 2017; as used
  by SimCLR (Chen et al., 2020, §B.1) and BYOL. Biases and normalisation parameters are excluded
  from weight decay and from the trust-ratio adaptation.
- Warm-up + cosine decay per optimiser step (Goyal et al., 2017; Loshchilov & Hutter, 2017);
  :class:`WarmupCosineLR` resumes with the schedule of the new run (see docs/cli.md).
- Learning-rate scaling rule: ``lr = base_lr × global_batch / 256`` ("linear", Goyal et al.) or
  ``base_lr × sqrt(global_batch)`` ("sqrt", SimCLR §B.1 for LARS with large batches).
- Layer-wise lr decay for ViTs (Bao et al., "BEiT: BERT Pre-Training of Image Transformers",
  ICLR 2022; DINOv2's ``get_vit_lr_decay_rate``): a per-group ``lr_multiplier`` on the peak lr,
  see docs/optimisation_schedules.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    import pytorch_lightning as pl

OptimizerName = Literal["lars", "sgd", "adamw"]
LRScaling = Literal["none", "linear", "sqrt"]


class LARS(Optimizer):
    """SGD with momentum and a layer-wise trust ratio ``eta·||w|| / ||g + wd·w||``.

    As in SimCLR's implementation, the weight decay is added to the gradient first and the
    trust ratio is taken of that sum (the LARS paper writes ``||g|| + wd·||w||``); the scaled
    step goes into the momentum buffer and the parameter moves by ``lr × buffer``.

    Parameter groups with ``exclude_from_lars=True`` (biases, norms) get plain SGD with momentum
    and no weight decay adaptation.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        momentum: Momentum factor.
        weight_decay: L2 penalty added to the gradient before the trust ratio.
        trust_coefficient: eta in the trust ratio (0.001 in the LARS paper).
        eps: Added to the denominator for stability.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
    ) -> None:
        if lr < 0:
            raise ValueError(f"LARS lr must be >= 0, got {lr}.")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, exclude_from_lars=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if not group["exclude_from_lars"]:
                    if group["weight_decay"] != 0:
                        grad = grad.add(p, alpha=group["weight_decay"])
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
                    trust = torch.where(
                        (w_norm > 0) & (g_norm > 0),
                        group["trust_coefficient"] * w_norm / (g_norm + group["eps"]),
                        torch.ones_like(w_norm),
                    )
                    grad = grad.mul(trust)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = grad.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(grad)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss


def split_decay_groups(
    modules: Iterable[nn.Module],
    weight_decay: float,
    lr_multipliers: Mapping[int, float] | None = None,
) -> list[dict]:
    """Weights with decay, and biases/norm parameters (ndim <= 1) without.

    The no-decay group is also marked ``exclude_from_lars``; the decay group
    ``weight_decay_schedule`` (the groups a cosine weight-decay schedule changes). Frozen
    parameters are skipped. Without ``lr_multipliers``: these two groups. With them
    (``id(parameter) -> factor``, 1 for a parameter not in it, see
    :func:`layer_decay_multipliers`): one such pair per distinct factor, in order of first
    appearance, each marked ``lr_multiplier`` (empty groups left out).
    """
    pairs: dict[float, tuple[list[nn.Parameter], list[nn.Parameter]]] = {}
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            factor = 1.0 if lr_multipliers is None else lr_multipliers.get(id(p), 1.0)
            decay, no_decay = pairs.setdefault(factor, ([], []))
            (no_decay if p.ndim <= 1 else decay).append(p)
    if lr_multipliers is None:
        decay, no_decay = pairs.get(1.0, ([], []))
        return [
            {"params": decay, "weight_decay": weight_decay, "weight_decay_schedule": True},
            {"params": no_decay, "weight_decay": 0.0, "exclude_from_lars": True},
        ]
    groups: list[dict] = []
    for factor, (decay, no_decay) in pairs.items():
        if decay:
            groups.append({"params": decay, "weight_decay": weight_decay,
                           "weight_decay_schedule": True, "lr_multiplier": factor})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0, "exclude_from_lars": True,
                           "lr_multiplier": factor})
    return groups


#: Parameters of a ViT that sit before the first block (layer 0 of layer-wise lr decay).
VIT_INPUT_PARAMETERS = ("patch_embed", "cls_token", "pos_embed", "register_tokens", "mask_token")


def vit_depth(backbone: nn.Module, argument: str = "layer_decay") -> int:
    """Number of transformer blocks of a ViT backbone, or a ``ValueError`` naming
    ``argument`` for a backbone without ``blocks`` and ``patch_embed`` (not a ViT)."""
    blocks = getattr(backbone, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not hasattr(backbone, "patch_embed"):
        raise ValueError(
            f"{argument} needs a ViT backbone with transformer blocks (ssl_lightning ViT: "
            f"patch_embed, blocks); {type(backbone).__name__} has none. Set {argument}: 1.0 "
            "for this backbone."
        )
    return len(blocks)


def check_layer_decay(backbone: nn.Module, layer_decay: float,
                      patch_embed_multiplier: float) -> None:
    """``ValueError`` unless ``0 < layer_decay <= 1``, ``patch_embed_multiplier > 0`` and, when
    either is not 1, ``backbone`` is a ViT (:func:`vit_depth`)."""
    if not 0 < layer_decay <= 1:
        raise ValueError(f"layer_decay must be in (0, 1] (1: no layer-wise decay), got "
                         f"{layer_decay}.")
    if not patch_embed_multiplier > 0:
        raise ValueError(f"patch_embed_lr_multiplier must be > 0, got {patch_embed_multiplier}.")
    for name, value in (("layer_decay", layer_decay),
                        ("patch_embed_lr_multiplier", patch_embed_multiplier)):
        if value != 1:
            vit_depth(backbone, name)


def vit_layer_id(name: str, depth: int) -> int:
    """Layer of the ViT parameter ``name`` (relative to the ViT): 0 for the patch embedding and
    the [CLS], position, register and mask tokens, ``i + 1`` for block ``i``, ``depth + 1``
    for the rest (the final norm)."""
    first, _, rest = name.partition(".")
    if first in VIT_INPUT_PARAMETERS:
        return 0
    if first == "blocks":
        return int(rest.partition(".")[0]) + 1
    return depth + 1


def layer_decay_multipliers(
    backbone: nn.Module, layer_decay: float, patch_embed_multiplier: float = 1.0
) -> dict[int, float]:
    """``id(parameter) -> layer_decay ** (depth + 1 − layer)`` for every ViT parameter
    (:func:`vit_layer_id`), × ``patch_embed_multiplier`` for the patch embedding. Parameters
    outside the backbone (heads) keep factor 1, like the final norm."""
    depth = vit_depth(backbone)
    multipliers = {}
    for name, p in backbone.named_parameters():
        factor = layer_decay ** (depth + 1 - vit_layer_id(name, depth))
        if name.startswith("patch_embed."):
            factor *= patch_embed_multiplier
        multipliers[id(p)] = factor
    return multipliers


def build_optimizer(
    name: OptimizerName,
    param_groups: list[dict],
    lr: float,
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    trust_coefficient: float = 0.001,
) -> Optimizer:
    """Build LARS, SGD or AdamW over ``param_groups`` (from :func:`split_decay_groups`); a group
    with an ``lr_multiplier`` gets ``lr × lr_multiplier`` as its (peak) lr."""
    param_groups = [{**g, "lr": lr * g["lr_multiplier"]} if "lr_multiplier" in g else g
                    for g in param_groups]
    if name == "lars":
        return LARS(param_groups, lr=lr, momentum=momentum, trust_coefficient=trust_coefficient)
    groups = [{k: v for k, v in g.items() if k != "exclude_from_lars"} for g in param_groups]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    raise ValueError(f"Unknown optimizer {name!r}; choose 'lars', 'sgd' or 'adamw'.")


def scale_lr(base_lr: float, global_batch_size: int, rule: LRScaling) -> float:
    """Apply the batch-size scaling rule to a base learning rate."""
    if rule == "linear":
        return base_lr * global_batch_size / 256
    if rule == "sqrt":
        return base_lr * math.sqrt(global_batch_size)
    if rule == "none":
        return base_lr
    raise ValueError(f"Unknown lr scaling rule {rule!r}; choose 'none', 'linear' or 'sqrt'.")


class WarmupCosine:
    """LR multiplier: linear warm-up from 0 over ``warmup_steps``, then cosine to ``final_ratio``.

    A picklable callable for ``torch.optim.lr_scheduler.LambdaLR``; the schedule is a pure
    function of the step, so the scheduler's ``last_epoch`` is all that resuming needs.
    """

    def __init__(self, warmup_steps: int, total_steps: int, final_ratio: float = 0.0) -> None:
        if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
            raise ValueError(
                f"Need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}), "
                "total_steps >= 1."
            )
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.final_ratio = final_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosineLR(LRScheduler):
    """Per-optimiser-step :class:`WarmupCosine` whose checkpoint restores the position only.

    Resuming continues with the schedule *of the new run*: its total steps, warm-up, peak lr
    (scaled for its global batch) and the optimiser hyperparameters it configured (weight decay,
    momentum, ...), while the step count and the optimiser's per-parameter state (momentum
    buffers) come from the checkpoint. Lightning loads the optimiser state first (which brings
    back the old groups' values) and this scheduler second, so :meth:`load_state_dict` puts the
    configured values back. When nothing changed this is exactly the stored state.

    When the steps per epoch changed (batch size, device count) and the run is bounded by
    ``max_epochs``, the position is converted through epochs (``step_shift``), so the new
    schedule ends with the last epoch instead of before it. A run bounded by ``max_steps`` keeps
    ``global_step`` as its position.

    Args:
        optimizer: The optimiser (its groups' ``lr`` are the peak values).
        warmup_steps, total_steps, final_ratio: See :class:`WarmupCosine`.
        fixed_groups: Per group, True to keep the peak lr throughout (no warm-up, no cosine).
        steps_per_epoch: Optimiser steps per epoch of this run.
        global_batch_size: This run's global batch (for the resume message), None if unknown.
        epoch_based: True when ``max_epochs`` bounds the run (see above).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        final_ratio: float = 0.0,
        fixed_groups: Sequence[bool] | None = None,
        steps_per_epoch: int = 1,
        global_batch_size: int | None = None,
        epoch_based: bool = True,
    ) -> None:
        self.schedule = WarmupCosine(warmup_steps, total_steps, final_ratio)
        self.fixed_groups = list(fixed_groups or [False] * len(optimizer.param_groups))
        self.steps_per_epoch, self.global_batch_size = steps_per_epoch, global_batch_size
        self.epoch_based, self.step_shift = epoch_based, 0
        self.optimizer_class = type(optimizer).__name__
        self._configured = [{k: v for k, v in g.items() if k not in ("params", "lr")}
                            for g in optimizer.param_groups]
        super().__init__(optimizer)

    def get_lr(self) -> list[float | Tensor]:
        factor = self.schedule(self.last_epoch + self.step_shift)
        return [base if fixed else base * factor
                for base, fixed in zip(self.base_lrs, self.fixed_groups, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (loadable with ``torch.load(weights_only=True)``)."""
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("optimizer", "schedule", "_configured")}
        state["schedule"] = dict(vars(self.schedule))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the step count from ``state_dict``, keep this run's schedule (warn if it
        differs)."""
        old = _StoredSchedule.read(state_dict)
        if old.optimizer_class not in (None, self.optimizer_class):
            raise ValueError(
                f"The checkpoint's optimiser state is of {old.optimizer_class}, this run uses "
                f"{self.optimizer_class}: resuming needs the same optimizer (set it back to the "
                "checkpoint's, or start a new run)."
            )
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        self.step_shift = old.step_shift if self.epoch_based else 0
        if self.epoch_based and old.steps_per_epoch not in (None, self.steps_per_epoch):
            epochs_done = (self.last_epoch + old.step_shift) / old.steps_per_epoch
            self.step_shift = round(epochs_done * self.steps_per_epoch) - self.last_epoch
        for group, configured in zip(self.optimizer.param_groups, self._configured, strict=True):
            group.update(configured)
        values = self.get_lr()
        for group, lr, base in zip(self.optimizer.param_groups, values, self.base_lrs, strict=True):
            group["lr"], group["initial_lr"] = lr, base
        self._last_lr = values
        changes = old.changes(self)
        if changes:
            warnings.warn(
                f"Resuming at step {self.last_epoch} with a changed schedule: "
                f"{'; '.join(changes)}. The new run's schedule is used: lr {values[0]:.6g} now "
                f"(step {self.last_epoch + self.step_shift} of {self.schedule.total_steps}).",
                UserWarning, stacklevel=2,
            )


def run_schedule(trainer: pl.Trainer, optimizer: Optimizer, warmup_epochs: float,
                 final_ratio: float = 0.0, global_batch_size: int | None = None
                 ) -> WarmupCosineLR:
    """The per-step :class:`WarmupCosineLR` of a run on ``trainer``: total steps from
    ``estimated_stepping_batches``, warm-up and steps per epoch from the train loader's length
    (after gradient accumulation). Groups marked ``fixed_lr`` keep their peak lr.

    Raises:
        ValueError: ``warmup_epochs > 0`` with a train loader without a length.
    """
    total_steps = int(trainer.estimated_stepping_batches)
    batches = trainer.num_training_batches
    if not math.isfinite(batches) and warmup_epochs > 0:
        raise ValueError(
            f"warmup_epochs={warmup_epochs} needs a train dataloader with a length; "
            "set warmup_epochs: 0 for an iterable dataset."
        )
    steps_per_epoch = (max(1, math.ceil(batches / trainer.accumulate_grad_batches))
                       if math.isfinite(batches) else 1)
    return WarmupCosineLR(
        optimizer, min(total_steps, round(warmup_epochs * steps_per_epoch)), total_steps,
        final_ratio, fixed_groups=[bool(g.get("fixed_lr")) for g in optimizer.param_groups],
        steps_per_epoch=steps_per_epoch, global_batch_size=global_batch_size,
        epoch_based=trainer.max_steps == -1 or total_steps < trainer.max_steps,
    )


def schedule_position(trainer: pl.Trainer, step: int) -> tuple[int, int]:
    """``(position, total steps)`` of optimiser step ``step`` in this run's per-step schedules.

    ``(step, estimated_stepping_batches)``, unless the lr scheduler is a resumed
    :class:`WarmupCosineLR` that converted its position through epochs (``step_shift``: the
    steps per epoch changed in a ``max_epochs``-bounded run). The other per-step schedules (EMA
    momentum, weight decay) then take the same position, so every schedule ends with the last
    epoch and stays consistent with the lr.
    """
    for config in trainer.lr_scheduler_configs:
        if isinstance(config.scheduler, WarmupCosineLR):
            return step + config.scheduler.step_shift, config.scheduler.schedule.total_steps
    return step, int(trainer.estimated_stepping_batches)


@dataclass
class _StoredSchedule:
    """The schedule a checkpoint was written with (also from a plain ``LambdaLR`` state)."""

    warmup_steps: int
    total_steps: int
    base_lrs: list[float]
    steps_per_epoch: int | None
    global_batch_size: int | None
    step_shift: int
    optimizer_class: str | None

    @classmethod
    def read(cls, state: dict[str, Any]) -> _StoredSchedule:
        schedule = state.get("schedule") or (state.get("lr_lambdas") or [{}])[0]
        return cls(schedule.get("warmup_steps", -1), schedule.get("total_steps", -1),
                   list(state["base_lrs"]), state.get("steps_per_epoch"),
                   state.get("global_batch_size"), state.get("step_shift", 0),
                   state.get("optimizer_class"))

    def changes(self, new: WarmupCosineLR) -> list[str]:
        """``"name old -> new"`` for every schedule quantity that differs from ``new``'s."""
        pairs: list[tuple[str, object, object]] = [
            ("total steps", self.total_steps, new.schedule.total_steps),
            ("warm-up steps", self.warmup_steps, new.schedule.warmup_steps),
            ("steps per epoch", self.steps_per_epoch, new.steps_per_epoch),
            ("global batch", self.global_batch_size, new.global_batch_size),
        ]
        if self.base_lrs != list(new.base_lrs):
            pairs.append(("peak lr", f"{self.base_lrs[0]:.6g}", f"{float(new.base_lrs[0]):.6g}"))
        return [f"{name} {before} -> {after}" for name, before, after in pairs
                if before not in (None, -1) and before != after]
