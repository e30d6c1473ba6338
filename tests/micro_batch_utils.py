"""The whole-batch and the micro-batched gradients of a method's training loss on one batch,
for the methods whose batches carry more than views (crop boxes, segment maps), which the
registry's micro-batching property does not build."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ssl_lightning.training.grad_cache import grad_cached_loss


def whole_and_micro_batch_gradients(make_method: Callable[[int | None], torch.nn.Module],
                                    batch: Sequence[Tensor], micro_batch_size: int = 2,
                                    ) -> tuple[Tensor, Tensor]:
    """The flattened parameter gradients of ``make_method(None)`` on the whole ``batch`` and of
    ``make_method(micro_batch_size)`` through :func:`grad_cached_loss`; ``make_method`` must
    build the same initial weights each time."""
    grads = []
    for micro in (None, micro_batch_size):
        method = make_method(micro)
        loss = grad_cached_loss(method, batch, micro)[0] if micro else \
            method.training_loss(batch)[0]
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in method.parameters()
                                if p.grad is not None]))
    return grads[0], grads[1]
