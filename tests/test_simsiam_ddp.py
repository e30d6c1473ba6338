"""Issue 5, check 2 for SimSiam: with 2 gloo processes and a BatchNorm-free model, the mean of
the rank losses and the DDP-averaged parameter gradients equal one process holding the global
batch. Every SimSiam term is per sample, so no collective is involved; summing instead of
averaging over the local batch (a known-bad variant) must fail the same comparison."""

import torch
import torch.distributed as dist
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.distributed import all_reduce_mean_no_grad
from ssl_lightning.methods import SimSiam

GLOBAL_BATCH = 8


def _views():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
            for _ in range(2)]


def _method() -> SimSiam:
    torch.manual_seed(0)
    return SimSiam(SmallConvNet(widths=(4, 8), norm="none"), projection_hidden_dim=8,
                   projection_dim=6, predictor_hidden_dim=4, batch_norm=False).double()


def _run(rank: int, world: int) -> dict:
    views = _views()
    batch = GLOBAL_BATCH // world
    local = [v[rank * batch:(rank + 1) * batch] for v in views]
    method = _method()
    results = {}
    for name, scale in [("mean", 1.0), ("sum", float(batch))]:  # "sum": the bad variant
        method.zero_grad()
        loss = scale * method.training_loss(local)[0]
        loss.backward()
        if dist.is_initialized():
            average_gradients_like_ddp(method)
            loss = all_reduce_mean_no_grad(loss.detach())
        results[name] = (loss.detach(), [p.grad.clone() for p in method.parameters()])
    return results


def test_two_processes_equal_the_global_batch():
    single = _run(0, 1)
    ref_loss, ref_grads = single["mean"]
    assert max(g.abs().max() for g in ref_grads) > 1e-3
    for result in run_in_processes(_run, 2):
        loss, grads = result["mean"]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
        for got, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
        # A per-rank sum instead of a mean is off by the batch-size ratio (4 vs 8): caught.
        bad_loss, _ = result["sum"]
        assert (bad_loss - single["sum"][0]).abs() > 1e-3
