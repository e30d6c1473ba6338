"""Masks and stochastic depth keyed by sample, end to end through Lightning in float64: 2 DDP
processes = 1 process holding the global batch = 1 process in micro-batches, weights (with the
teachers and the [CLS] and patch centres) after 3 optimiser steps to 1e-9, for iBOT (EMA
centres) and DINOv2 (Sinkhorn, global KoLeo, registers) with masks on, DINOv3 (Gram anchoring
across two Gram-teacher snapshots, its teacher on 32 px crops resized to the student's grid) and
DINO, all with a ViT of ``drop_path_rate`` 0.3.

One spawn (2 gloo processes) runs every 2-process fit with Lightning's DDP strategy on the
spawned processes; the batches carry sample seeds as the data modules' do (``(views, targets,
sample_seeds)``). The single process sees the samples in the samplers' order (local sample j of
rank r is global position j·2 + r), as a real 1-process run does. Known-bad variants run in the
same workers and must differ from the single process: the masks and drop-path decisions drawn
per rank (the former behaviour: torch's generator reseeded per rank), and KoLeo neighbours, the
patch centre and the Sinkhorn sums / masked-patch counts of each rank's own batch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from distributed_utils import run_in_processes
from torch import Tensor
from torch.utils.data import DistributedSampler, Subset

import ssl_lightning.losses.ibot_patch as ibot_patch_module
import ssl_lightning.losses.sinkhorn as sinkhorn_module
from ssl_lightning.backbones import ViT
from ssl_lightning.methods import DINO, IBOT, DINOv2, DINOv3
from ssl_lightning.testing.trainer_runs import KeyedViews, fit_weights

pytestmark = pytest.mark.slow

STEPS, BATCH, WORLD = 3, 4, 2
SAMPLES = STEPS * BATCH * WORLD
HEADS = dict(head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8, optimizer="sgd", lr=0.5,
             lr_scaling="none", warmup_epochs=0, weight_decay=1e-4, momentum_base=0.9,
             warmup_teacher_temperature_epochs=0, teacher_temperature=0.05,
             freeze_last_layer_epochs=0, rng_seed=7)
MASKED = dict(num_local_crops=1, mask_probability=0.5, patch_out_dim=12, shared_head=False,
              patch_teacher_temperature=0.05)
#: DINOv3's Gram teacher: snapshots at steps 0 and 1, then frozen; per-module clipping.
GRAM = dict(patch_hidden_dim=12, patch_bottleneck_dim=6, clip_grad=0.5, gram_weight=2.0,
            gram_start_step=0, gram_refresh_every=1, gram_max_refreshes=1)
#: The views of each kind (DINOv3: + 2 Gram-teacher crops of 32 px, an 8x8 patch grid).
VIEW_SIZES = {"dinov3": (16, 16, 8, 32, 32)}


class PerRankIBOT(IBOT):
    """Known-bad: no sample keys, so masks and drop path come from a per-rank stream."""

    def sample_keys(self, sample_seeds: Tensor, batch_idx: int) -> Any:
        return None


def make_model(kind: str, **kwargs: Any) -> pl.LightningModule:
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              drop_path_rate=0.3, mask_token=kind != "dino", num_registers=kind == "dinov2")
    cls = {"dino": DINO, "ibot": IBOT, "dinov2": DINOv2, "per_rank_ibot": PerRankIBOT,
           "ibot_pp": IBOT, "dinov3": DINOv3}[kind]
    extra = {} if kind == "dino" else MASKED
    if kind == "dinov3":
        extra = {**MASKED, **GRAM}
    if kind == "ibot_pp":  # iBOT++: the patch loss also on the visible patches
        extra = {**MASKED, "patch_visible_weight": 0.5}
    return cls(vit, **{**HEADS, **extra, **kwargs})


def keyed_views(kind: str = "dino") -> KeyedViews:
    """The float64 views of every sample of ``kind``, with its epoch-0 seed."""
    return KeyedViews(SAMPLES, view_sizes=VIEW_SIZES.get(kind, (16, 16, 8)), seed=3,
                      dtype=torch.float64)


def _worker(rank: int, world: int) -> dict[str, dict]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    out = {kind: fit_weights(make_model(kind), keyed_views(kind), BATCH, world, steps=STEPS)
           for kind in ("dino", "ibot", "dinov2", "per_rank_ibot", "ibot_pp", "dinov3")}
    # Known-bad shared statistics: KoLeo neighbours, the patch centre, the Sinkhorn sums and
    # masked-patch counts of each rank's own batch.
    out["koleo_local"] = fit_weights(make_model("dinov2", koleo_scope="local"), keyed_views(),
                                     BATCH, world, steps=STEPS)
    real_mean = ibot_patch_module.all_reduce_mean_no_grad
    ibot_patch_module.all_reduce_mean_no_grad = lambda x: x
    out["patch_center_local"] = fit_weights(make_model("ibot"), keyed_views(), BATCH, world,
                                            steps=STEPS)
    ibot_patch_module.all_reduce_mean_no_grad = real_mean
    sinkhorn_module.all_reduce_sum_no_grad = lambda x: x
    sinkhorn_module.world_size = lambda: 1
    ibot_patch_module.all_reduce_sum_no_grad = lambda x: x
    out["sinkhorn_local"] = fit_weights(make_model("dinov2"), keyed_views(), BATCH, world,
                                        steps=STEPS)
    return out


def global_order() -> list[int]:
    """The samplers' order: one process's batch s is the interleaved rank batches s."""
    return list(DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, seed=0))


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], dict[str, dict]]:
    ranks = run_in_processes(_worker, WORLD)

    def data(kind: str) -> Subset:
        return Subset(keyed_views(kind), global_order())

    single = {kind: fit_weights(make_model(kind), data(kind), BATCH * WORLD, 1, steps=STEPS)
              for kind in ("dino", "ibot", "dinov2", "ibot_pp", "dinov3")}
    single.update({f"{kind}_micro": fit_weights(make_model(kind, micro_batch_size=BATCH // 2),
                                                data(kind), BATCH * WORLD, 1, steps=STEPS)
                   for kind in ("ibot", "dinov2", "ibot_pp", "dinov3")})
    single["dinov3_no_gram"] = fit_weights(make_model("dinov3", gram_weight=0.0), data("dinov3"),
                                           BATCH * WORLD, 1, steps=STEPS)
    return ranks, single


def assert_weights_close(actual: dict, expected: dict, atol: float = 1e-9) -> None:
    for key, value in expected.items():
        if value.is_floating_point():
            torch.testing.assert_close(actual[key], value, atol=atol, rtol=0,
                                       msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("kind", ["dino", "ibot", "dinov2", "ibot_pp", "dinov3"])
def test_two_processes_equal_one_process_holding_the_global_batch(results, kind: str) -> None:
    ranks, single = results
    start = make_model(kind).double().state_dict()
    moved = (single[kind]["backbone.blocks.1.qkv.weight"] - start["backbone.blocks.1.qkv.weight"])
    assert moved.abs().max() > 1e-3  # three real steps
    if kind == "ibot":  # the patch centre (over masked and unmasked teacher tokens) moved
        assert single[kind]["patch_criterion.center"].abs().max() > 0
    for rank_state in ranks:
        assert_weights_close(rank_state[kind], single[kind])


@pytest.mark.parametrize("kind", ["ibot", "dinov2", "ibot_pp", "dinov3"])
def test_micro_batches_equal_the_whole_batch(results, kind: str) -> None:
    _, single = results
    assert_weights_close(single[f"{kind}_micro"], single[kind])


@pytest.mark.parametrize("bad, kind", [("per_rank_ibot", "ibot"), ("koleo_local", "dinov2"),
                                       ("patch_center_local", "ibot"),
                                       ("sinkhorn_local", "dinov2")])
def test_known_bad_variants_differ(results, bad: str, kind: str) -> None:
    """Masks and drop path drawn per rank; KoLeo, patch centre, Sinkhorn per rank."""
    ranks, single = results
    diff = max((ranks[0][bad][k] - v).abs().max().item()
               for k, v in single[kind].items() if v.is_floating_point())
    assert diff > 1e-6


def test_dinov3_gram_anchoring_is_on_across_two_snapshots(results) -> None:
    """The DINOv3 runs above train with the Gram term (other weights without it) and their
    Gram teacher was refreshed at step 1, then frozen (on both processes as on one)."""
    ranks, single = results
    state = single["dinov3"]
    assert int(state["gram_teacher.snapshot_step"]) == 1
    assert all(int(r["dinov3"]["gram_teacher.snapshot_step"]) == 1 for r in ranks)
    key = "backbone.blocks.0.mlp.0.weight"
    assert (state[key] - single["dinov3_no_gram"][key]).abs().max() > 1e-6
