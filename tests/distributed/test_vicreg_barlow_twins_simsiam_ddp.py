"""With 2 gloo processes, the mean of the rank losses and the DDP-averaged
parameter gradients of VICReg, Barlow Twins and SimSiam equal one process holding the global
batch (gradient ratio 1, not 1/2), in float64 to 1e-12.

For VICReg and Barlow Twins the same harness is run with a plain, non-autograd
``dist.all_reduce`` in place of the autograd-aware collective: the loss value stays right but the
gradient does not (Barlow Twins: about half, least-squares ratio 0.47 here), so the comparison
is shown to bite. One process spawn serves all three methods (spawning dominates the cost).
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.distributed import (
    all_gather_with_grad,
    all_reduce_mean_no_grad,
    all_reduce_sum_with_grad,
)
from ssl_lightning.losses import BarlowTwinsLoss, VICRegLoss
from ssl_lightning.methods import BarlowTwins, SimSiam, VICReg

pytestmark = pytest.mark.slow

GLOBAL_BATCH, IN_DIM, EMBED_DIM = 8, 6, 5


def gather_by_plain_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Known-bad gather: zero-pad the local block and sum it with a plain all_reduce, which
    autograd treats as the identity, so only the local block gets a gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = torch.cat([x.new_zeros(rank * len(x), x.shape[1]), x,
                        x.new_zeros((world - rank - 1) * len(x), x.shape[1])])
    dist.all_reduce(padded)
    return padded


def plain_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Known-bad reduction (the official Barlow Twins code's): in-place ``dist.all_reduce``."""
    summed = x.clone()
    dist.all_reduce(summed)
    return summed


def _loss_and_grads(module: torch.nn.Module, loss_fn) -> tuple:
    module.zero_grad()
    loss = loss_fn()
    loss.backward()
    if dist.is_initialized():
        average_gradients_like_ddp(module)
        loss = all_reduce_mean_no_grad(loss.detach())
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def _seeded(make):
    torch.manual_seed(0)
    return make().double()


def _all_cases(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(GLOBAL_BATCH, IN_DIM, generator=g, dtype=torch.float64)
    x2 = x1 + 0.5 * torch.randn(x1.shape, generator=g, dtype=torch.float64)
    views = [torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
             for _ in range(2)]
    batch = GLOBAL_BATCH // world
    local = slice(rank * batch, (rank + 1) * batch)
    local_views = [v[local] for v in views]
    embedder = _seeded(lambda: torch.nn.Linear(IN_DIM, EMBED_DIM))
    backbone = lambda: SmallConvNet(widths=(4, 8), norm="none")  # noqa: E731  (BatchNorm-free)
    methods = {
        "vicreg": _seeded(lambda: VICReg(backbone(), expander_hidden_dim=8, expander_dim=6,
                                         head_batch_norm=False)),
        "barlow": _seeded(lambda: BarlowTwins(backbone(), projection_hidden_dim=8,
                                              projection_dim=6, head_batch_norm=False,
                                              lambda_offdiag=0.1)),
        "simsiam": _seeded(lambda: SimSiam(backbone(), projection_hidden_dim=8, projection_dim=6,
                                           predictor_hidden_dim=4, head_batch_norm=False)),
    }
    vicreg, barlow = VICRegLoss(), BarlowTwinsLoss(0.1)
    loss_fns = {
        "vicreg": lambda gather: vicreg(*(embedder(x[local]) for x in (x1, x2)),
                                        *(gather(embedder(x[local])) for x in (x1, x2))),
        "barlow": lambda reduce: barlow(embedder(x1[local]), embedder(x2[local]), reduce),
    }
    good = {"vicreg": all_gather_with_grad, "barlow": all_reduce_sum_with_grad}
    bad = {"vicreg": gather_by_plain_all_reduce, "barlow": plain_all_reduce}
    results: dict = {name: {} for name in methods}
    for name, loss_fn in loss_fns.items():
        results[name]["loss"] = _loss_and_grads(embedder, partial(loss_fn, good[name]))
        if world > 1:
            results[name]["plain"] = _loss_and_grads(embedder, partial(loss_fn, bad[name]))
    for name, method in methods.items():
        results[name]["method"] = _loss_and_grads(
            method, lambda m=method: m.training_loss(local_views)[0])
    return results


def make_runs() -> tuple[dict, list[dict]]:
    return _all_cases(0, 1), run_in_processes(_all_cases, 2)


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads])


def _assert_equal(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-12)
    assert _flat(expected[1]).abs().max() > 1e-3  # the gradients are not trivially zero
    for g, e in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_vicreg_equals_the_global_batch_and_plain_all_reduce_does_not(runs):
    single, ranks = runs
    for rank_results in ranks:
        result = rank_results["vicreg"]
        _assert_equal(result["loss"], single["vicreg"]["loss"])
        _assert_equal(result["method"], single["vicreg"]["method"])
        bad_loss, bad_grads = result["plain"]
        torch.testing.assert_close(bad_loss, single["vicreg"]["loss"][0], rtol=0, atol=1e-12)
        ref = _flat(single["vicreg"]["loss"][1])
        assert (_flat(bad_grads) - ref).norm() > 0.1 * ref.norm()


def test_barlow_twins_equals_the_global_batch_and_plain_all_reduce_does_not(runs):
    single, ranks = runs
    for rank_results in ranks:
        result = rank_results["barlow"]
        _assert_equal(result["loss"], single["barlow"]["loss"])
        _assert_equal(result["method"], single["barlow"]["method"])
        # Plain all_reduce: right loss value, but the gradient misses the other rank's share of
        # every cross-rank path, so it is about half the true one.
        bad_loss, bad_grads = result["plain"]
        torch.testing.assert_close(bad_loss, single["barlow"]["loss"][0], rtol=0, atol=1e-12)
        bad, ref = _flat(bad_grads), _flat(single["barlow"]["loss"][1])
        assert (bad - ref).norm() > 0.3 * ref.norm()
        assert 0.35 < (bad @ ref / (ref @ ref)).item() < 0.65


def test_simsiam_equals_the_global_batch(runs):
    single, ranks = runs
    for rank_results in ranks:
        _assert_equal(rank_results["simsiam"]["method"], single["simsiam"]["method"])
