"""LARS: You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks", 2017; as used
by SimCLR (Chen et al., 2020, §B.1) and BYOL. Biases and normalisation parameters are excluded
from weight decay and from the trust-ratio adaptation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer


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
