"""Optimisers and schedules for SSL pre-training.

- LARS: You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks", 2017; as used
  by SimCLR (Chen et al., 2020, §B.1) and BYOL. Biases and normalisation parameters are excluded
  from weight decay and from the trust-ratio adaptation.
- Warm-up + cosine decay per optimiser step (Goyal et al., 2017; Loshchilov & Hutter, 2017).
- Learning-rate scaling rule: ``lr = base_lr × global_batch / 256`` ("linear", Goyal et al.) or
  ``base_lr × sqrt(global_batch)`` ("sqrt", SimCLR §B.1 for LARS with large batches).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn
from torch.optim import Optimizer

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


def split_decay_groups(modules: Iterable[nn.Module], weight_decay: float) -> list[dict]:
    """Two parameter groups: weights with decay, and biases/norm parameters (ndim <= 1) without.

    The second group is also marked ``exclude_from_lars``. Frozen parameters are skipped.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0, "exclude_from_lars": True},
    ]


def build_optimizer(
    name: OptimizerName,
    param_groups: list[dict],
    lr: float,
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    trust_coefficient: float = 0.001,
) -> Optimizer:
    """Build LARS, SGD or AdamW over ``param_groups`` (from :func:`split_decay_groups`)."""
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
