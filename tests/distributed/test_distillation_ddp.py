"""Distillation on 2 gloo processes vs one process holding the global batch, float64.

GroupNorm ConvNet student and ViT teacher (no BatchNorm), deterministic images. Rank r gets
samples ``r::2`` of each global batch (the distributed sampler's order), which global-batch
mixup undoes, so each step mixes the same pairs with the same weight on 1 and 2 processes; the
queue receives the gathered teacher embeddings, rank-major (a known permutation of the
single-process rows). Known-bad: a per-rank queue (only the local embeddings enqueued).
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import average_gradients_like_ddp, run_in_processes
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.methods import Distillation

pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH, STEPS, QUEUE, SIZE = 2, 4, 3, 8, 16


class PerRankQueue(Distillation):
    """Known-bad: each rank enqueues only its own teacher embeddings (as lightly-train does)."""

    def enqueue_teacher(self, teacher_global: Tensor) -> None:
        self.queue.enqueue(torch.nn.functional.normalize(teacher_global, dim=1))


def _images(step: int) -> Tensor:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(GLOBAL_BATCH, 3, SIZE, SIZE, generator=g, dtype=torch.float64)


def _train(rank: int, world: int, cls: type[Distillation]) -> dict:
    torch.manual_seed(0)
    teacher = ViT(image_size=SIZE, patch_size=4, embed_dim=16, depth=1, num_heads=2)
    model = cls(SmallConvNet((8, 16)), teacher=teacher, queue_size=QUEUE, image_size=SIZE,
                local_weight=0.5).double()
    opt = torch.optim.SGD([p for m in model.trainable_modules() for p in m.parameters()], lr=0.5)
    losses, grads = [], []
    for step in range(STEPS):
        x = model.mix(_images(step)[rank::world], seed=1000 + step)
        loss, _ = model.training_loss([x])
        opt.zero_grad()
        loss.backward()
        if world > 1:
            average_gradients_like_ddp(model)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                if p.grad is not None]))
        opt.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": grads, "queue": model.queue.queue.clone(),
            "teacher_grads": [n for n, p in model.teacher.named_parameters() if p.grad is not None]}


def _both(rank: int, world: int) -> dict:
    return {"good": _train(rank, world, Distillation), "bad": _train(rank, world, PerRankQueue)}


def make_runs() -> tuple[list[dict], dict]:
    """One 2-process spawn for both variants, and the single-process reference."""
    return run_in_processes(_both, WORLD), _both(0, 1)


def test_two_processes_train_like_one(runs) -> None:  # type: ignore[no-untyped-def]
    ranks, single = [r["good"] for r in runs[0]], runs[1]["good"]
    mean_losses = torch.stack([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(mean_losses, single["losses"], atol=1e-9, rtol=0)
    # each enqueued block holds the embeddings of samples [0, 2, 1, 3] of its step
    order = [b + i for b in range(0, QUEUE, GLOBAL_BATCH) for i in (0, 2, 1, 3)]
    for result in ranks:
        torch.testing.assert_close(result["queue"], single["queue"][order], atol=1e-9, rtol=0)
        for step, grad in enumerate(single["grads"]):
            torch.testing.assert_close(result["grads"][step], grad, atol=1e-9, rtol=0,
                                       msg=f"step {step}")
        assert result["teacher_grads"] == []


def test_a_per_rank_queue_differs(runs) -> None:  # type: ignore[no-untyped-def]
    ranks, single = [r["bad"] for r in runs[0]], runs[1]["bad"]
    assert torch.equal(single["losses"], runs[1]["good"]["losses"])  # same on one process
    mean_losses = torch.stack([r["losses"] for r in ranks]).mean(0)
    assert (mean_losses - single["losses"]).abs().max() > 1e-4
