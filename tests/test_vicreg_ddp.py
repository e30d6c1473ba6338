"""Issue 5, check 2 for VICReg: with 2 gloo processes, the mean of the rank losses and the
DDP-averaged parameter gradients equal one process holding the global batch (ratio 1, not
1/2); the same harness with a plain, non-autograd ``dist.all_reduce`` must fail."""

import torch
import torch.distributed as dist
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.distributed import all_gather_with_grad, all_reduce_mean_no_grad
from ssl_lightning.losses import VICRegLoss
from ssl_lightning.methods import VICReg

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


def _method() -> VICReg:
    torch.manual_seed(0)
    return VICReg(SmallConvNet(widths=(4, 8), norm="none"), expander_hidden_dim=8,
                  expander_dim=6, expander_batch_norm=False).double()


def gather_by_plain_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The known-bad gather: zero-pad the local block and sum it with a plain all_reduce, which
    autograd sees as the identity, so only the local block gets a gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = torch.cat([x.new_zeros(rank * len(x), x.shape[1]), x,
                        x.new_zeros((world - rank - 1) * len(x), x.shape[1])])
    dist.all_reduce(padded)
    return padded


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
    embedder, method, criterion = _embedder(), _method(), VICRegLoss()
    results = {}
    variants = [("autograd", all_gather_with_grad)]
    if world > 1:
        variants.append(("plain_all_reduce", gather_by_plain_all_reduce))
    for name, gather in variants:
        def loss_fn(gather=gather):
            z1, z2 = embedder(x1[local]), embedder(x2[local])
            return criterion(z1, z2, gather(z1), gather(z2))
        results[name] = _loss_and_grads(embedder, loss_fn)
    results["method"] = _loss_and_grads(
        method, lambda: method.training_loss([v[local] for v in views])[0])
    return results


def test_two_processes_equal_the_global_batch_and_plain_all_reduce_does_not():
    single = _all_cases(0, 1)
    ranks = run_in_processes(_all_cases, 2)
    loss, grads = single["autograd"]
    for result in ranks:
        good_loss, good_grads = result["autograd"]
        torch.testing.assert_close(good_loss, loss, rtol=0, atol=1e-12)
        assert max(ref.abs().max() for ref in grads) > 1e-3
        for good, ref in zip(good_grads, grads, strict=True):
            torch.testing.assert_close(good, ref, rtol=0, atol=1e-12)
        # Same harness, plain all_reduce: the loss value is right but the gradient is not.
        bad_loss, bad_grads = result["plain_all_reduce"]
        torch.testing.assert_close(bad_loss, loss, rtol=0, atol=1e-12)
        errors = [(bad - ref).abs().max() for bad, ref in zip(bad_grads, grads, strict=True)]
        assert max(errors) > 1e-3
        # The method end to end (gather through SSLMethod.gather, BatchNorm-free model).
        method_loss, method_grads = result["method"]
        ref_loss, ref_grads = single["method"]
        torch.testing.assert_close(method_loss, ref_loss, rtol=0, atol=1e-12)
        for got, ref in zip(method_grads, ref_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
