"""SimMIM and AIM end to end through Lightning in float64 (``precision="64-true"``), masks and
prefixes keyed by sample (the batches carry the sample seeds, as the data modules' do), with a
ViT of ``drop_path_rate`` 0.3: 2 DDP processes = 1 process holding the global batch = 1 process
in micro-batches of 2, weights after 3 optimiser steps to 1e-9.

One spawn (2 gloo processes) runs every 2-process fit, known-bad variants included: SimMIM's
masks and AIM's prefixes drawn from a per-rank stream (the ranks then mask and cut other images
than one process holding the global batch does).
The single process sees the samples in the samplers' order (local sample j of rank r is global
position j·2 + r).
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

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import AIM, SimMIM
from ssl_lightning.testing.trainer_runs import KeyedViews, fit_weights

pytestmark = pytest.mark.slow

STEPS, BATCH, WORLD = 3, 4, 2
SAMPLES = STEPS * BATCH * WORLD
OPTIM = dict(optimizer="adamw", lr=1e-2, lr_scaling="none", warmup_epochs=0, image_size=16,
             rng_seed=7)


class _PerRankSimMIM(SimMIM):
    """Known-bad: masks from a stream seeded by the rank, not by the sample."""

    def draw_masks(self, batch: int) -> Tensor:
        torch.manual_seed(self.global_rank)
        return self.masking(batch)


class _PerRankAIM(AIM):
    """Known-bad: prefixes from a stream seeded by the rank, not by the sample."""

    def draw_prefix(self, batch: int) -> Tensor:
        generator = torch.Generator().manual_seed(self.global_rank)
        low, high = self.prefix_range
        return torch.randint(low, high + 1, (batch,), generator=generator)


def make_model(kind: str, **kwargs: Any) -> pl.LightningModule:
    torch.manual_seed(0)
    simmim = "simmim" in kind
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              drop_path_rate=0.3, mask_token=simmim)
    if simmim:
        cls = _PerRankSimMIM if kind == "per_rank_simmim" else SimMIM
        return cls(vit, mask_patch_size=8, **OPTIM, **kwargs)
    cls = _PerRankAIM if kind == "per_rank_aim" else AIM
    return cls(vit, head_hidden_dim=16, head_layers=2, **OPTIM, **kwargs)


def keyed_views() -> KeyedViews:
    """The float64 views of every sample, with its epoch-0 seed."""
    return KeyedViews(SAMPLES, view_sizes=(16,), seed=3, dtype=torch.float64)


KINDS = ("simmim", "aim", "per_rank_simmim", "per_rank_aim")


def _worker(rank: int, world: int) -> dict[str, dict]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    return {kind: fit_weights(make_model(kind), keyed_views(), BATCH, world, steps=STEPS)
            for kind in KINDS}


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], dict[str, dict]]:
    ranks = run_in_processes(_worker, WORLD)
    order = list(DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, seed=0))
    data = Subset(keyed_views(), order)
    single = {kind: fit_weights(make_model(kind), data, BATCH * WORLD, 1, steps=STEPS)
              for kind in ("simmim", "aim")}
    single.update({f"{kind}_micro": fit_weights(make_model(kind, micro_batch_size=2), data,
                                                BATCH * WORLD, 1, steps=STEPS)
                   for kind in ("simmim", "aim")})
    return ranks, single


def _max_difference(actual: dict, expected: dict) -> float:
    return max((actual[k] - v).abs().max().item() for k, v in expected.items()
               if v.is_floating_point())


@pytest.mark.parametrize("kind", ["simmim", "aim"])
def test_two_processes_equal_one_process_holding_the_global_batch(results, kind: str) -> None:
    ranks, single = results
    start = make_model(kind).double().state_dict()
    moved = single[kind]["backbone.blocks.1.qkv.weight"] - start["backbone.blocks.1.qkv.weight"]
    assert moved.abs().max() > 1e-3  # three real steps
    for rank_state in ranks:
        assert _max_difference(rank_state[kind], single[kind]) < 1e-9


@pytest.mark.parametrize("kind", ["simmim", "aim"])
def test_micro_batches_equal_the_whole_batch(results, kind: str) -> None:
    _, single = results
    assert _max_difference(single[f"{kind}_micro"], single[kind]) < 1e-9


@pytest.mark.parametrize("bad, kind", [("per_rank_simmim", "simmim"), ("per_rank_aim", "aim")])
def test_known_bad_variants_differ(results, bad: str, kind: str) -> None:
    ranks, single = results
    assert _max_difference(ranks[0][bad], single[kind]) > 1e-6
