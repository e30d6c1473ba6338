"""MoCo v2 and v3 on 2 gloo processes vs one process holding the global batch.

BatchNorm-free model (GroupNorm ConvNet, heads without BN), float64, deterministic views. Rank r
gets samples ``r::2`` of each global batch (DistributedSampler order), so the keys gathered in
rank-major order are a known permutation of the single-process batch.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import MoCoV2, MoCoV3
from ssl_lightning.training.ema import ema_update_

pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH, STEPS, QUEUE = 2, 4, 3, 8


def _views(step: int, n: int = GLOBAL_BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)]


def _moco_v2(shuffle_bn: bool) -> MoCoV2:
    torch.manual_seed(0)
    return MoCoV2(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                  queue_size=QUEUE, temperature=0.2, shuffle_bn=shuffle_bn, image_size=8).double()


def _train_moco_v2(rank: int, world: int, shuffle_bn: bool) -> dict:
    """STEPS optimiser steps + EMA updates on this rank's slice ``rank::world``."""
    model = _moco_v2(shuffle_bn)
    opt = torch.optim.SGD([p for m in model.trainable_modules() for p in m.parameters()], lr=0.5)
    losses = []
    for step in range(STEPS):
        views = [v[rank::world] for v in _views(step)]
        loss, _ = model.training_loss(views)
        opt.zero_grad()
        loss.backward()
        if world > 1:
            average_gradients_like_ddp(model)
        opt.step()
        ema_update_(model.ema_pairs(), tau=0.9)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "queue": model.queue.queue.clone(),
            "ptr": int(model.queue.queue_ptr),
            "key_encoder": torch.cat([p.flatten() for p in model.teacher_backbone.parameters()])}


def _both(rank: int, world: int) -> dict:
    # shuffle_bn=True: the 2-process run takes the gather-permute-encode-unshuffle path.
    return {"v2": _train_moco_v2(rank, world, True), "v3": _moco_v3_grads(rank, world)}


def make_runs() -> tuple[list[dict], dict]:
    """One 2-process spawn for both MoCo checks, and the single-process reference."""
    return run_in_processes(_both, WORLD), _both(0, 1)


def test_moco_v2_queue_and_pointer_match_single_process(runs) -> None:  # type: ignore[no-untyped-def]
    ranks, single = [r["v2"] for r in runs[0]], runs[1]["v2"]
    # Each enqueued block of the 2-process run holds keys of samples [0, 2, 1, 3] of the step.
    within_block = [i for r in range(WORLD) for i in range(r, GLOBAL_BATCH, WORLD)]
    order = [b + i for b in range(0, QUEUE, GLOBAL_BATCH) for i in within_block]
    assert STEPS * GLOBAL_BATCH > QUEUE  # the ring buffer wrapped around
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["queue"], single["queue"][order], atol=1e-10, rtol=0,
                                   msg=f"rank {rank} queue")
        assert result["ptr"] == single["ptr"] == (STEPS * GLOBAL_BATCH) % QUEUE
        torch.testing.assert_close(result["key_encoder"], single["key_encoder"], atol=1e-10,
                                   rtol=0)
    mean_losses = torch.stack([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(mean_losses, single["losses"], atol=1e-10, rtol=0)


def _moco_v3() -> MoCoV3:
    torch.manual_seed(0)
    return MoCoV3(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                  projection_layers=2, head_batch_norm=False, temperature=0.2,
                  image_size=8).double()


def _moco_v3_grads(rank: int, world: int) -> dict:
    model = _moco_v3()
    views = [v[rank::world] for v in _views(0, 8)]
    loss, _ = model.training_loss(views)
    loss.backward()
    if world > 1:
        average_gradients_like_ddp(model)
    # Known-bad variant: labels without the rank offset (every rank thinks it is rank 0).
    with torch.no_grad():
        q1 = model.predictor(model.projector(model.backbone(views[0])))
        q2 = model.predictor(model.projector(model.backbone(views[1])))
        k1 = model.gather_no_grad(model.teacher_projector(model.teacher_backbone(views[0])))
        k2 = model.gather_no_grad(model.teacher_projector(model.teacher_backbone(views[1])))
        no_offset = model.criterion(q1, k2, 0) + model.criterion(q2, k1, 0)
    return {"loss": loss.detach(), "no_offset": no_offset,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def test_moco_v3_loss_and_gradients_match_single_process(runs) -> None:  # type: ignore[no-untyped-def]
    ranks, single = [r["v3"] for r in runs[0]], runs[1]["v3"]
    mean_loss = sum(r["loss"] for r in ranks) / WORLD
    torch.testing.assert_close(mean_loss, single["loss"], atol=1e-10, rtol=0)
    assert not torch.allclose(sum(r["no_offset"] for r in ranks) / WORLD, single["loss"])
    assert set(single["grads"]) == set(ranks[0]["grads"])
    assert not any(n.startswith("teacher_") for n in single["grads"])  # momentum encoder: no grad
    for name, grad in single["grads"].items():
        for result in ranks:
            torch.testing.assert_close(result["grads"][name], grad, atol=1e-10, rtol=0, msg=name)
