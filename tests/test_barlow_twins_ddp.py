"""Issue 5, check 2 for Barlow Twins: with 2 gloo processes, the mean of the rank losses and the
DDP-averaged parameter gradients equal one process holding the global batch (ratio 1); the same
harness with a plain, non-autograd ``dist.all_reduce`` (the official code's pattern) gives
about half the gradient (least-squares ratio 0.47 here) and fails."""

import torch
import torch.distributed as dist
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.distributed import all_reduce_mean_no_grad, all_reduce_sum_with_grad
from ssl_lightning.losses import BarlowTwinsLoss
from ssl_lightning.methods import BarlowTwins

GLOBAL_BATCH, IN_DIM, EMBED_DIM = 8, 6, 5


def _inputs():
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(GLOBAL_BATCH, IN_DIM, generator=g, dtype=torch.float64)
    views = [torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
             for _ in range(2)]
    return x1, x1 + 0.5 * torch.randn(x1.shape, generator=g, dtype=torch.float64), views


def _embedder() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(IN_DIM, EMBED_DIM).double()


def _method() -> BarlowTwins:
    torch.manual_seed(0)
    return BarlowTwins(SmallConvNet(widths=(4, 8), norm="none"), projection_hidden_dim=8,
                       projection_dim=6, projection_batch_norm=False, lambda_offdiag=0.1).double()


def plain_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The known-bad reduction: autograd treats an in-place ``dist.all_reduce`` as the identity,
    so only this rank's contribution receives a gradient."""
    summed = x.clone()
    dist.all_reduce(summed)
    return summed


def _loss_and_grads(module, loss_fn):
    module.zero_grad()
    loss = loss_fn()
    loss.backward()
    if dist.is_initialized():
        average_gradients_like_ddp(module)
        loss = all_reduce_mean_no_grad(loss.detach())
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def _all_cases(rank: int, world: int) -> dict:
    x1, x2, views = _inputs()
    batch = GLOBAL_BATCH // world
    local = slice(rank * batch, (rank + 1) * batch)
    embedder, method, criterion = _embedder(), _method(), BarlowTwinsLoss(0.1)
    variants = [("autograd", all_reduce_sum_with_grad)]
    if world > 1:
        variants.append(("plain_all_reduce", plain_all_reduce))
    results = {}
    for name, reduce_sum in variants:
        results[name] = _loss_and_grads(
            embedder, lambda r=reduce_sum: criterion(embedder(x1[local]), embedder(x2[local]), r))
    results["method"] = _loss_and_grads(
        method, lambda: method.training_loss([v[local] for v in views])[0])
    return results


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads])


def test_two_processes_equal_the_global_batch_and_plain_all_reduce_does_not():
    single = _all_cases(0, 1)
    ranks = run_in_processes(_all_cases, 2)
    loss, grads = single["autograd"]
    assert max(g.abs().max() for g in grads) > 1e-2
    for result in ranks:
        good_loss, good_grads = result["autograd"]
        torch.testing.assert_close(good_loss, loss, rtol=0, atol=1e-12)
        for good, ref in zip(good_grads, grads, strict=True):
            torch.testing.assert_close(good, ref, rtol=0, atol=1e-12)
        # Same harness, plain all_reduce: right loss value, but the gradient misses the other
        # rank's share of every cross-rank path, so it is about half the true one.
        bad_loss, bad_grads = result["plain_all_reduce"]
        torch.testing.assert_close(bad_loss, loss, rtol=0, atol=1e-12)
        bad, ref = _flat(bad_grads), _flat(grads)
        assert (bad - ref).norm() > 0.3 * ref.norm()
        assert 0.35 < (bad @ ref / (ref @ ref)).item() < 0.65
        # The method end to end (statistics through all_reduce_sum_with_grad, BN-free model).
        method_loss, method_grads = result["method"]
        ref_loss, ref_grads = single["method"]
        torch.testing.assert_close(method_loss, ref_loss, rtol=0, atol=1e-12)
        assert max(g.abs().max() for g in ref_grads) > 1e-3
        for got, ref in zip(method_grads, ref_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
