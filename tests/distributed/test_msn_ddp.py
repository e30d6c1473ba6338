"""MSN and PMSN end to end through Lightning in float64: 2 DDP processes = 1 process holding the
global batch = 1 process in micro-batches, weights (backbone, projector, prototypes, EMA
teachers) after 3 optimiser steps to 1e-9, with the anchor view's tokens dropped (keyed by
sample), stochastic depth 0.3, Sinkhorn targets and a focal view.

One spawn (2 gloo processes) runs every 2-process fit; the batches carry sample seeds as the data
modules' do. The single process sees the samples in the samplers' order. Known-bad variants run
in the same workers and must differ from the single process:

- the mean anchor prediction p̄ of the regulariser taken over the local batch (lightly's MSNLoss
  without ``gather_distributed``);
- p̄ summed by a plain (non-autograd) all_reduce: the regulariser's gradient is 1/world_size;
- Sinkhorn on the local batch (row sums and sample count of this rank only);
- masks drawn per rank (no sample keys).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from distributed_utils import run_in_processes
from torch import Tensor
from torch.utils.data import DistributedSampler, Subset

import ssl_lightning.losses.sinkhorn as sinkhorn_module
from ssl_lightning.backbones import ViT
from ssl_lightning.losses import MSNLoss
from ssl_lightning.methods import MSN, PMSN
from ssl_lightning.testing.trainer_runs import KeyedViews, fit_weights

pytestmark = pytest.mark.slow

STEPS, BATCH, WORLD = 3, 4, 2
SAMPLES = STEPS * BATCH * WORLD
ARGS = dict(projection_hidden_dim=16, projection_dim=8, num_prototypes=10,
            head_batch_norm=False, mask_ratio=0.25, image_size=16, optimizer="sgd", lr=0.5,
            lr_scaling="none", warmup_epochs=0, weight_decay=1e-4, weight_decay_end=None,
            momentum_base=0.9, rng_seed=7)


def plain_all_reduce(x: Tensor) -> Tensor:
    """Known-bad: a non-autograd all_reduce (the backward keeps only the local share)."""
    summed = x.clone()
    dist.all_reduce(summed)
    return summed


class LocalMeanMSN(MSN):
    """Known-bad: p̄ over this rank's anchors only."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["anchors"], outputs["targets"], self.prototypes.weight)


class PlainAllReduceMSN(MSN):
    """Known-bad: p̄'s sums through a plain all_reduce."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["anchors"], outputs["targets"], self.prototypes.weight,
                              plain_all_reduce)


class LocalSinkhornLoss(MSNLoss):
    """Known-bad: Sinkhorn normalises over this rank's targets only."""

    def targets(self, target_logits: Tensor) -> Tensor:
        real = sinkhorn_module.all_reduce_sum_no_grad, sinkhorn_module.world_size
        sinkhorn_module.all_reduce_sum_no_grad = lambda x: x
        sinkhorn_module.world_size = lambda: 1
        try:
            return super().targets(target_logits)
        finally:
            sinkhorn_module.all_reduce_sum_no_grad, sinkhorn_module.world_size = real


class LocalSinkhornMSN(MSN):
    def build_criterion(self) -> MSNLoss:
        hp = self.hparams
        return LocalSinkhornLoss(hp["temperature"], hp["sharpen_temperature"],
                                 hp["sinkhorn_iterations"], hp["regularization_weight"])


class PerRankMasksMSN(MSN):
    """Known-bad: no sample keys, so masks and drop path come from a per-rank stream."""

    def sample_keys(self, sample_seeds: Tensor, batch_idx: int) -> Any:
        return None


KINDS = {"msn": MSN, "pmsn": PMSN, "local_mean": LocalMeanMSN,
         "plain_all_reduce": PlainAllReduceMSN, "local_sinkhorn": LocalSinkhornMSN,
         "per_rank_masks": PerRankMasksMSN}
BAD = ("local_mean", "plain_all_reduce", "local_sinkhorn", "per_rank_masks")


def make_model(kind: str, **kwargs: Any) -> pl.LightningModule:
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              drop_path_rate=0.3)
    return KINDS[kind](vit, **ARGS, **kwargs)


def keyed_views() -> KeyedViews:
    """The float64 views of every sample, with its epoch-0 seed."""
    return KeyedViews(SAMPLES, view_sizes=(16, 16, 8), seed=3, dtype=torch.float64)


def _worker(rank: int, world: int) -> dict[str, dict]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    return {kind: fit_weights(make_model(kind), keyed_views(), BATCH, world, steps=STEPS)
            for kind in KINDS}


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], dict[str, dict]]:
    ranks = run_in_processes(_worker, WORLD)
    order = list(DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, seed=0))
    data = Subset(keyed_views(), order)
    single = {kind: fit_weights(make_model(kind), data, BATCH * WORLD, 1, steps=STEPS)
              for kind in ("msn", "pmsn")}
    single.update({f"{kind}_micro": fit_weights(make_model(kind, micro_batch_size=BATCH // 2),
                                                data, BATCH * WORLD, 1, steps=STEPS)
                   for kind in ("msn", "pmsn")})
    return ranks, single


def assert_weights_close(actual: dict, expected: dict, atol: float = 1e-9) -> None:
    for key, value in expected.items():
        if value.is_floating_point():
            torch.testing.assert_close(actual[key], value, atol=atol, rtol=0,
                                       msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("kind", ["msn", "pmsn"])
def test_two_processes_equal_one_process_holding_the_global_batch(results, kind: str) -> None:
    ranks, single = results
    start = make_model(kind).double().state_dict()
    for key in ("backbone.blocks.1.qkv.weight", "prototypes.layer.weight",
                "teacher_projector.4.weight"):
        assert (single[kind][key] - start[key]).abs().max() > 1e-4, key  # three real steps
    for rank_state in ranks:
        assert_weights_close(rank_state[kind], single[kind])


@pytest.mark.parametrize("kind", ["msn", "pmsn"])
def test_micro_batches_equal_the_whole_batch(results, kind: str) -> None:
    _, single = results
    assert_weights_close(single[f"{kind}_micro"], single[kind])


def test_pmsn_differs_from_msn(results) -> None:
    _, single = results
    diff = (single["pmsn"]["prototypes.layer.weight"] - single["msn"]["prototypes.layer.weight"])
    assert diff.abs().max() > 1e-6


@pytest.mark.parametrize("bad", BAD)
def test_known_bad_variant_differs(results, bad: str) -> None:
    ranks, single = results
    diff = max((ranks[0][bad][k] - v).abs().max().item()
               for k, v in single["msn"].items() if v.is_floating_point())
    assert diff > 1e-6, f"{bad}: {diff:.2e}"
