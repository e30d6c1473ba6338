"""2 processes == 1 process holding the global batch, for Sinkhorn, DINO and SwAV.

One spawn (``run_in_processes``) runs every distributed check, because starting processes is the
expensive part on CPU. Each rank takes a contiguous half of every precomputed batch, runs a few
optimiser steps of the method (backward, DDP-style gradient averaging, SGD, EMA for DINO) and
returns losses, gradients and state; the single-process reference runs the same loop on the
whole batch in the test process. The known-bad variants (centre or Sinkhorn sums left per rank)
run in the same workers and must differ from the reference.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import backward_like_ddp, run_in_processes

import ssl_lightning.losses.dino as dino_loss_module
import ssl_lightning.losses.sinkhorn as sinkhorn_module
from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import sinkhorn_knopp
from ssl_lightning.methods import DINO, SwAV
from ssl_lightning.training.ema import ema_update_

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH = 3, 8


def make_views(seed: int) -> list[list[torch.Tensor]]:
    """STEPS batches of 2 global (16 px) + 2 local (8 px) views of GLOBAL_BATCH samples."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(GLOBAL_BATCH, 3, s, s, generator=g) for s in (16, 16, 8, 8)]
            for _ in range(STEPS)]


def make_dino() -> DINO:
    torch.manual_seed(0)
    return DINO(SmallConvNet((8, 16), norm="none"), head_out_dim=32, head_hidden_dim=16,
                head_bottleneck_dim=8, warmup_teacher_temperature_epochs=0,
                teacher_temperature=0.05, clip_grad=0.5)


def make_swav() -> SwAV:
    torch.manual_seed(0)
    return SwAV(SmallConvNet((8, 16), norm="none"), projection_hidden_dim=16, projection_dim=8,
                head_batch_norm=False, num_prototypes=10, freeze_prototypes_steps=0,
                queue_size=8, queue_start_epoch=0)


def run_steps(model, batches, rank: int = 0, world: int = 1) -> dict:
    """The training loop of both methods without a Trainer; returns per-step records."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    record: dict[str, list] = {"loss": [], "grads": [], "center": [], "queue": []}
    for views in batches:
        local = [v.chunk(world)[rank] for v in views]
        optimizer.zero_grad()
        loss = model.training_loss(local)[0]
        loss = backward_like_ddp(model, loss, world)
        if isinstance(model, DINO):
            model.adjust_gradients_(epoch=1)
        record["loss"].append(loss.item())
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None})
        optimizer.step()
        if isinstance(model, DINO):
            ema_update_(model.ema_pairs(), 0.9)
            record["center"].append(model.criterion.center.clone())
        else:
            record["queue"].append(model.queue.clone())
    record["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return record


def _worker(rank: int, world: int, scores: torch.Tensor, batches: list) -> dict:
    out = {"codes": sinkhorn_knopp(scores.chunk(world)[rank], 0.05, 3),
           "dino": run_steps(make_dino(), batches, rank, world),
           "swav": run_steps(make_swav(), batches, rank, world)}
    # Known-bad variants: per-rank centre; per-rank Sinkhorn normalisation.
    dino_loss_module.all_reduce_mean_no_grad = lambda x: x
    out["dino_local_center"] = run_steps(make_dino(), batches, rank, world)["center"]
    sinkhorn_module.all_reduce_sum_no_grad = lambda x: x
    sinkhorn_module.world_size = lambda: 1
    out["codes_local"] = sinkhorn_knopp(scores.chunk(world)[rank], 0.05, 3)
    out["swav_local_grads"] = run_steps(make_swav(), batches, rank, world)["grads"]
    return out


@pytest.fixture(scope="module")
def results():
    g = torch.Generator().manual_seed(5)
    z = torch.nn.functional.normalize(torch.randn(16, 8, generator=g), dim=1)
    c = torch.nn.functional.normalize(torch.randn(6, 8, generator=g), dim=1)
    scores, batches = z @ c.T, make_views(1)
    ranks = run_in_processes(_worker, 2, scores, batches)
    single = {"codes": sinkhorn_knopp(scores, 0.05, 3),
              "dino": run_steps(make_dino(), batches), "swav": run_steps(make_swav(), batches)}
    return ranks, single


def assert_grads_close(actual: list[dict], expected: list[dict], atol: float = 1e-6) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.keys() == e.keys(), step
        for name in e:
            torch.testing.assert_close(a[name], e[name], atol=atol, rtol=1e-5,
                                       msg=f"step {step} {name}")


def test_distributed_sinkhorn_equals_single_process_on_concatenated_scores(results):
    ranks, single = results
    codes = torch.cat([r["codes"] for r in ranks])
    torch.testing.assert_close(codes, single["codes"], rtol=1e-6, atol=1e-7)
    local = torch.cat([r["codes_local"] for r in ranks])
    assert (local - single["codes"]).abs().max() > 1e-3


def test_dino_loss_gradients_centre_and_teacher_equal_global_batch(results):
    ranks, single = results
    for r in ranks:
        assert r["dino"]["loss"] == pytest.approx(single["dino"]["loss"], rel=1e-6, abs=1e-6)
        assert_grads_close(r["dino"]["grads"], single["dino"]["grads"])
        for got, want in zip(r["dino"]["center"], single["dino"]["center"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
        for key, value in single["dino"]["state"].items():
            torch.testing.assert_close(r["dino"]["state"][key], value, atol=1e-6, rtol=1e-5,
                                       msg=key)
    # A centre averaged over the rank's own samples only drifts from the global one.
    bad = ranks[0]["dino_local_center"][-1]
    assert (bad - single["dino"]["center"][-1]).abs().max() > 1e-4


def test_swav_loss_gradients_and_queue_equal_global_batch(results):
    ranks, single = results
    assert single["swav"]["queue"][-1].abs().sum() > 0  # the queue was filled and used
    for r in ranks:
        assert r["swav"]["loss"] == pytest.approx(single["swav"]["loss"], rel=1e-6, abs=1e-6)
        assert_grads_close(r["swav"]["grads"], single["swav"]["grads"])
        for got, want in zip(r["swav"]["queue"], single["swav"]["queue"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(AssertionError):
        assert_grads_close(ranks[0]["swav_local_grads"], single["swav"]["grads"])
