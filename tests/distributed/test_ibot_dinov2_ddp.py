"""2 processes == 1 process holding the global batch, for iBOT (EMA centres), DINOv2 (Sinkhorn
centring, KoLeo over the global batch) and DINOv3 with Gram anchoring (float64, in the same spawn:
see tests/dinov3_utils.py).

One spawn runs every check. Each rank takes a contiguous half of every precomputed batch and of
its precomputed block masks (``draw_masks`` replaced, so both runs mask the same patches), runs a
few optimiser steps (backward, DDP-style gradient averaging, clipping, SGD, EMA) and returns
losses, gradients, centres and the final state; the single-process reference runs the same loop
on the whole batch. The known-bad variants run in the same workers and must differ: Sinkhorn sums
and masked-patch counts left per rank, KoLeo neighbours searched per rank when global is
configured, patch centre averaged per rank.
"""

from __future__ import annotations

import pytest
import torch
from dinov3_utils import check_dinov3_equal, dinov3_runs
from distributed_utils import backward_like_ddp, run_in_processes

import ssl_lightning.losses.ibot_patch as ibot_patch_module
import ssl_lightning.losses.sinkhorn as sinkhorn_module
from ssl_lightning.backbones import ViT
from ssl_lightning.masking import BlockMasking
from ssl_lightning.methods import IBOT, DINOv2
from ssl_lightning.training.ema import ema_update_

STEPS, GLOBAL_BATCH, LR = 2, 8, 0.05
SMALL = dict(head_out_dim=32, head_hidden_dim=16, head_bottleneck_dim=8, shared_head=False,
             patch_out_dim=24, warmup_teacher_temperature_epochs=0, teacher_temperature=0.05,
             patch_teacher_temperature=0.05, clip_grad=0.5, num_local_crops=1)


def make_model(kind: str, **kwargs) -> IBOT:
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, mask_token=True,
              num_registers=1 if kind == "dinov2" else 0)
    if kind == "dinov2":
        return DINOv2(vit, **SMALL, **kwargs)
    return IBOT(vit, **SMALL, centering="center", **kwargs)


def make_data(seed: int) -> tuple[list, list]:
    """STEPS batches of 2 global (16 px) + 1 local (8 px) views and their (B, 2, 16) masks."""
    g = torch.Generator().manual_seed(seed)
    batches = [[torch.randn(GLOBAL_BATCH, 3, s, s, generator=g) for s in (16, 16, 8)]
               for _ in range(STEPS)]
    torch.manual_seed(seed)
    generator = BlockMasking(ratio=(0.1, 0.5), probability=0.5)
    masks = [generator(2 * GLOBAL_BATCH, (4, 4)).view(GLOBAL_BATCH, 2, 16) for _ in range(STEPS)]
    return batches, masks


def run_steps(model: IBOT, batches, masks, rank: int = 0, world: int = 1) -> dict:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    record: dict[str, list] = {"loss": [], "grads": [], "centers": []}
    for views, step_masks in zip(batches, masks, strict=True):
        local = [v.chunk(world)[rank] for v in views]
        model.draw_masks = lambda batch, grid, m=step_masks: m.chunk(world)[rank]
        optimizer.zero_grad()
        loss = model.training_loss(local)[0]
        loss = backward_like_ddp(model, loss, world)
        model.adjust_gradients_(epoch=1)
        record["loss"].append(loss.item())
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None})
        optimizer.step()
        ema_update_(model.ema_pairs(), 0.9)
        record["centers"].append((model.criterion.center.clone(),
                                  model.patch_criterion.center.clone()))
    record["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return record


def _worker(rank: int, world: int, batches: list, masks: list) -> dict:
    out = {"dinov3": dinov3_runs(rank, world),
           "ibot": run_steps(make_model("ibot"), batches, masks, rank, world),
           "dinov2": run_steps(make_model("dinov2"), batches, masks, rank, world)}
    # Known-bad variants.
    out["koleo_local"] = run_steps(make_model("dinov2", koleo_scope="local"), batches, masks,
                                   rank, world)
    real_mean = ibot_patch_module.all_reduce_mean_no_grad
    ibot_patch_module.all_reduce_mean_no_grad = lambda x: x
    out["patch_center_local"] = run_steps(make_model("ibot"), batches, masks, rank, world)
    ibot_patch_module.all_reduce_mean_no_grad = real_mean
    sinkhorn_module.all_reduce_sum_no_grad = lambda x: x
    sinkhorn_module.world_size = lambda: 1
    ibot_patch_module.all_reduce_sum_no_grad = lambda x: x
    out["sinkhorn_local"] = run_steps(make_model("dinov2", koleo_weight=0.0), batches, masks,
                                      rank, world)
    return out


@pytest.fixture(scope="module")
def results():
    batches, masks = make_data(1)
    # The ranks hold different numbers of masked patches.
    assert any(m.chunk(2)[0].sum() != m.chunk(2)[1].sum() for m in masks)
    ranks = run_in_processes(_worker, 2, batches, masks)
    single = {"ibot": run_steps(make_model("ibot"), batches, masks),
              "dinov2": run_steps(make_model("dinov2"), batches, masks),
              "dinov2_no_koleo": run_steps(make_model("dinov2", koleo_weight=0.0), batches,
                                           masks),
              "dinov3": dinov3_runs()}
    return ranks, single


def grads_close(actual: list[dict], expected: list[dict], rtol: float = 1e-5) -> bool:
    """Every parameter's gradient within ``1e-6 + rtol·||expected||`` (L2) at every step: fp32
    round-off of the first step grows through KoLeo's 1/distance in the second."""
    return all(a.keys() == e.keys() and all(
        torch.linalg.vector_norm(a[n] - e[n]) <= 1e-6 + rtol * torch.linalg.vector_norm(e[n])
        for n in e) for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("kind", ["ibot", "dinov2"])
def test_losses_gradients_centres_and_teachers_equal_global_batch(results, kind):
    ranks, single = results
    want = single[kind]
    assert want["grads"][0]["backbone.mask_token"].abs().sum() > 0
    for r in ranks:
        got = r[kind]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
        assert grads_close(got["grads"], want["grads"])
        for (cls, patch), (cls_want, patch_want) in zip(got["centers"], want["centers"],
                                                        strict=True):
            torch.testing.assert_close(cls, cls_want, atol=1e-7, rtol=1e-6)
            torch.testing.assert_close(patch, patch_want, atol=1e-7, rtol=1e-6)
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-6, rtol=1e-5, msg=key)
    if kind == "ibot":
        assert want["centers"][-1][1].abs().sum() > 0
    else:  # Sinkhorn: the EMA centres are not used
        assert want["centers"][-1][0].abs().sum() == 0


def test_known_bad_variants_differ_from_global_batch(results):
    ranks, single = results
    # KoLeo neighbours within each rank's half: another loss and other gradients.
    bad = ranks[0]["koleo_local"]
    assert abs(bad["loss"][0] - single["dinov2"]["loss"][0]) > 1e-4
    assert not grads_close(bad["grads"], single["dinov2"]["grads"])
    # Patch centre averaged over the rank's own tokens only.
    centre, want = ranks[0]["patch_center_local"]["centers"][-1][1], single["ibot"]["centers"]
    assert (centre - want[-1][1]).abs().max() > 1e-5
    # Sinkhorn row sums and masked-patch counts per rank: other targets, other gradients.
    assert not grads_close(ranks[0]["sinkhorn_local"]["grads"],
                           single["dinov2_no_koleo"]["grads"])


def test_dinov3_gram_two_processes_equal_global_batch_float64(results):
    ranks, single = results
    check_dinov3_equal([r["dinov3"] for r in ranks], single["dinov3"])
