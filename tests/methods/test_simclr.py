"""Loss-level DDP equivalence of NT-Xent / SimCLR with 2 gloo processes.

Each rank feeds its slice of the global batch through the projector, scores its own anchors
against the candidates gathered from both ranks, and backpropagates; gradients are then averaged
as DDP does. The mean of the rank losses and the averaged gradients must equal one process
holding the whole batch. A gather whose backward keeps only the local slice (dropping the
gradient that the other rank's anchors send to this rank's candidates) must be caught.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import average_gradients_like_ddp, run_in_processes
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.distributed import all_gather_no_grad, all_gather_with_grad
from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import NTXentLoss
from ssl_lightning.methods import SimCLR

pytestmark = pytest.mark.slow

WORLD, BATCH, IN_DIM = 2, 4, 6


class _LocalSliceGather(torch.autograd.Function):
    """Known-bad gather: forward concatenates all ranks, backward returns only the local slice
    of the incoming gradient instead of summing this slice's gradient over all ranks."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.rank, ctx.batch = torch.distributed.get_rank(), x.shape[0]
        return all_gather_no_grad(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad[ctx.rank * ctx.batch : (ctx.rank + 1) * ctx.batch]


def _data() -> dict:
    torch.manual_seed(0)
    head = ProjectionHead(IN_DIM, 16, 8, batch_norm=False)
    return {
        "head": head.state_dict(),
        "x1": torch.randn(WORLD * BATCH, IN_DIM),
        "x2": torch.randn(WORLD * BATCH, IN_DIM),
        "views": [torch.randn(WORLD * BATCH, 3, 8, 8) for _ in range(2)],
    }


def _head(state: dict) -> ProjectionHead:
    head = ProjectionHead(IN_DIM, 16, 8, batch_norm=False)
    head.load_state_dict(state)
    return head


def _simclr() -> SimCLR:
    torch.manual_seed(1)
    return SimCLR(SmallConvNet(widths=(4, 8)), projection_hidden_dim=16, projection_dim=8,
                  head_batch_norm=False, temperature=0.5)


def _projector_step(head: ProjectionHead, x1: Tensor, x2: Tensor, gather, offset: int):
    z1, z2 = head(x1), head(x2)
    loss = NTXentLoss(temperature=0.3)(z1, z2, gather(z1), gather(z2), offset)
    loss.backward()
    return loss.detach()


def _grads(module: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _rank_fn(rank: int, world: int, data: dict) -> dict:
    """One spawn runs the three rank-side computations (spawning is the slow part)."""
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    out = {}
    for name, gather in (("good", all_gather_with_grad), ("bad", _LocalSliceGather.apply)):
        head = _head(data["head"])
        loss = _projector_step(head, data["x1"][local], data["x2"][local], gather, rank * BATCH)
        average_gradients_like_ddp(head)
        out[name] = (loss, _grads(head))
    model = _simclr()
    loss, features = model.training_loss([v[local] for v in data["views"]])
    loss.backward()
    average_gradients_like_ddp(model)
    out["simclr"] = (loss.detach(), features.detach(), _grads(model))
    return out


def _max_grad_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def make_runs():
    data = _data()
    head = _head(data["head"])
    loss = _projector_step(head, data["x1"], data["x2"], lambda z: z, 0)
    model = _simclr()
    simclr_loss, features = model.training_loss(data["views"])
    simclr_loss.backward()
    single = {"projector": (loss, _grads(head)),
              "simclr": (simclr_loss.detach(), features.detach(), _grads(model))}
    return single, run_in_processes(_rank_fn, WORLD, data)


def test_rank_losses_and_ddp_gradients_equal_single_process(runs) -> None:
    single, ranks = runs
    loss, grads = single["projector"]
    rank_losses = torch.stack([r["good"][0] for r in ranks])
    torch.testing.assert_close(rank_losses.mean(), loss, atol=1e-6, rtol=0)
    assert not torch.allclose(rank_losses[0], rank_losses[1])  # the ranks saw different anchors
    for r in ranks:
        assert _max_grad_diff(r["good"][1], grads) < 1e-6


def test_gather_that_keeps_only_the_local_gradient_slice_is_caught(runs) -> None:
    single, ranks = runs
    loss, grads = single["projector"]
    # The forward is identical, only the backward is wrong, so the losses still agree ...
    torch.testing.assert_close(torch.stack([r["bad"][0] for r in ranks]).mean(), loss,
                               atol=1e-6, rtol=0)
    # ... and the equivalence check on the gradients is what catches it.
    assert _max_grad_diff(ranks[0]["bad"][1], grads) > 1e-3


def test_simclr_method_outside_a_trainer_matches_single_process(runs) -> None:
    single, ranks = runs
    loss, features, grads = single["simclr"]
    torch.testing.assert_close(torch.stack([r["simclr"][0] for r in ranks]).mean(), loss,
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([r["simclr"][1] for r in ranks]), features)
    for r in ranks:
        assert _max_grad_diff(r["simclr"][2], grads) < 1e-6
