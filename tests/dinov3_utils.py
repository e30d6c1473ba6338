"""DINOv3 with Gram anchoring, 2 processes == 1 process holding the global batch, in float64.

The ranks run in tests/distributed/test_sample_rng_ddp.py's spawn (one process group for the
family). Each rank takes a contiguous half of every precomputed batch (2 global 16 px crops, 1
local 8 px crop, 2 Gram-teacher crops at 32 px whose 8×8 patch features are resized to the
student's 4×4 grid) and of its injected block masks (``draw_masks`` replaced, as in the iBOT
test), refreshes the Gram teacher on its schedule (steps 0 and 1, then frozen), and runs
backward, DDP-style gradient averaging, per-module clipping, SGD and the EMA update. The
single-process run does the same on the whole batch. Float64: the bound is 1e-9.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import backward_like_ddp

from ssl_lightning.backbones import ViT
from ssl_lightning.masking import BlockMasking
from ssl_lightning.methods import DINOv3
from ssl_lightning.training.ema import ema_update_

STEPS, GLOBAL_BATCH, LR = 3, 8, 0.05


def make_model(**kwargs) -> DINOv3:
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, mask_token=True,
              num_registers=1)
    args = dict(head_out_dim=32, patch_out_dim=24, head_hidden_dim=16, head_bottleneck_dim=8,
                patch_hidden_dim=12, patch_bottleneck_dim=6,
                num_local_crops=1, warmup_teacher_temperature_epochs=0, teacher_temperature=0.05,
                patch_teacher_temperature=0.05, clip_grad=0.5, gram_weight=2.0,
                gram_start_step=0, gram_refresh_every=1, gram_max_refreshes=1)
    return DINOv3(vit, **{**args, **kwargs}).double()


def make_data(seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    batches = [[torch.randn(GLOBAL_BATCH, 3, s, s, generator=g, dtype=torch.float64)
                for s in (16, 16, 8, 32, 32)] for _ in range(STEPS)]
    torch.manual_seed(seed)
    generator = BlockMasking(ratio=(0.1, 0.5), probability=0.5)
    masks = [generator(2 * GLOBAL_BATCH, (4, 4)).view(GLOBAL_BATCH, 2, 16) for _ in range(STEPS)]
    return batches, masks


def run_steps(model: DINOv3, batches, masks, rank: int = 0, world: int = 1) -> dict:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    record: dict[str, list] = {"loss": [], "grads": [], "refreshed": []}
    for step, (views, step_masks) in enumerate(zip(batches, masks, strict=True)):
        record["refreshed"].append(model.refresh_gram_teacher(step))
        local = [v.chunk(world)[rank] for v in views]
        model.draw_masks = lambda batch, grid, m=step_masks: m.chunk(world)[rank]
        optimizer.zero_grad()
        loss = backward_like_ddp(model, model.training_loss(local)[0], world)
        model.adjust_gradients_(epoch=1)
        record["loss"].append(loss.item())
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None})
        optimizer.step()
        ema_update_(model.ema_pairs(), 0.9)
    record["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return record


def dinov3_runs(rank: int = 0, world: int = 1) -> dict:
    """This rank's DINOv3 run (world > 1), or the single-process runs (with and without Gram)."""
    batches, masks = make_data(2)
    if world > 1:
        return run_steps(make_model(), batches, masks, rank, world)
    return {"dinov3": run_steps(make_model(), batches, masks),
            "no_gram": run_steps(make_model(gram_weight=0.0), batches, masks)}


def check_dinov3_equal(ranks: list[dict], single: dict) -> None:
    """Every rank's losses, gradients and final state (Gram teacher included) equal the
    single-process run's to 1e-9 (float64)."""
    want = single["dinov3"]
    assert want["refreshed"] == [True, True, False]
    # The Gram term is on and moves the student: other losses and gradients without it.
    assert abs(want["loss"][0] - single["no_gram"]["loss"][0]) > 1e-4
    assert (want["grads"][0]["backbone.blocks.0.mlp.0.weight"]
            - single["no_gram"]["grads"][0]["backbone.blocks.0.mlp.0.weight"]).abs().max() > 1e-6
    for r in ranks:
        got = r
        assert got["refreshed"] == want["refreshed"], (got["refreshed"], want["refreshed"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10, abs=1e-10), (
            f"2-process losses {got['loss']} != 1-process {want['loss']}")
        for step_got, step_want in zip(got["grads"], want["grads"], strict=True):
            assert step_got.keys() == step_want.keys(), "other parameters have gradients"
            for name, grad in step_want.items():
                torch.testing.assert_close(step_got[name], grad, atol=1e-9, rtol=1e-9, msg=name)
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-9, rtol=1e-9, msg=key)
    assert int(want["state"]["gram_teacher.snapshot_step"]) == 1  # refreshed at 1, then frozen
