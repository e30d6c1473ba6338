"""MoCo v2+, FastSiam, NNSiam, NNBYOL, DirectCLR, iBOT++, ReSSL, All4One, DeepCluster v2 and SMoG
trained by Lightning on 2 CPU processes (``strategy="ddp"``, gloo, float64) end with the weights,
teachers, queues (as contents: their slots follow the enqueue order) and pointers (DeepCluster
v2: dataset bank, k-means assignments, prototypes; SMoG: groups, bank) of one process fed the
global batch in the sampler's order, to 1e-9 (DeepCluster v2 with its initial forward pass
filling the bank from each rank's share); spherical k-means on the ranks' row shares gives the
centroids of one process on all rows.

One spawn (``run_in_processes``) runs every method: each worker already holds the process group,
so Lightning's DDP strategy joins it (``LOCAL_RANK`` / ``WORLD_SIZE`` set: processes launched
externally) and several Trainer fits share the two processes. The known-bad variants, an NNSiam
support set filled from the rank's own projections only, an All4One feature term on each
rank's own batch statistics (solo-learn's), DeepCluster v2 k-means whose sums and counts are
not summed over ranks (local centroids), a DeepCluster v2 initial pass writing only the rank's
own rows (no gather) and SMoG groups moved by the rank's own projections,
must differ.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from distributed_utils import run_in_processes
from torch import Tensor
from torch.utils.data import Subset

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.clustering import DatasetBank, initial_centroids, spherical_kmeans
from ssl_lightning.methods import (
    IBOT,
    NNBYOL,
    All4One,
    DeepClusterV2,
    DirectCLR,
    FastSiam,
    MoCoV2Plus,
    NNSiam,
    ReSSL,
    SMoG,
    SSLMethod,
)
from ssl_lightning.testing.trainer_runs import (
    KeyedViews,
    PrecomputedViews,
    TensorDataModule,
    ddp_global_order,
    queue_contents,
)

pytestmark = pytest.mark.slow

BATCH, STEPS, SAMPLES = 4, 3, 24
OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)
HEADS = dict(projection_hidden_dim=16, projection_dim=8)


class _LocalSupportSetNNSiam(NNSiam):
    """Known-bad: the support set receives this rank's projections only."""

    def gather(self, x: Tensor) -> Tensor:
        return x if not x.requires_grad else super().gather(x)


class _LocalBank(DatasetBank):
    """Known-bad: k-means statistics of this rank's rows only (no sum over ranks)."""

    def reduce(self, x: Tensor) -> Tensor:
        return x


class _LocalKMeansDeepClusterV2(DeepClusterV2):
    """Known-bad: DeepCluster v2 with :class:`_LocalBank`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bank.__class__ = _LocalBank


class _LocalInitDeepClusterV2(DeepClusterV2):
    """Known-bad: the initial pass writes this rank's rows only (the other rows stay random)."""

    _local_rows = False

    def fill_bank(self) -> None:
        self._local_rows = True
        try:
            super().fill_bank()
        finally:
            self._local_rows = False

    def gather_no_grad(self, x: Tensor) -> Tensor:
        return x if self._local_rows else super().gather_no_grad(x)


class _LocalGroupsSMoG(SMoG):
    """Known-bad: groups and bank moved by this rank's projections only."""

    def gather_no_grad(self, x: Tensor) -> Tensor:
        return x


class _FixedMasksIBOT(IBOT):
    """iBOT++ with masks that are a function of the sample's sampler position in the global
    batch (the same in both runs; the method's own masks come from a per-rank stream)."""

    def draw_masks(self, batch: int, grid: tuple[int, int]) -> Tensor:
        patches = grid[0] * grid[1]
        index = (torch.arange(batch) * self.trainer.world_size + self.global_rank)[:, None, None]
        view, patch = torch.arange(2)[None, :, None], torch.arange(patches)[None, None, :]
        return (index + view + patch) % 3 == 0


class _LocalStatisticsAll4One(All4One):
    """Known-bad: the feature term's column norms and cross-correlation from this rank only."""

    def reduce_sum(self, x: Tensor) -> Tensor:
        return x


def _all4one(cls: type[All4One] = All4One) -> All4One:
    return cls(_convnet(), queue_size=16, predictor_hidden_dim=8, head_batch_norm=False,
               neighbours=3, transformer_layers=1, transformer_heads=2, momentum_base=0.9,
               **HEADS, **OPTIM)


def _convnet() -> SmallConvNet:
    return SmallConvNet((4, 8), norm="group")


def _ibot() -> IBOT:
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, mask_token=True)
    return _FixedMasksIBOT(vit, head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8,
                           warmup_teacher_temperature_epochs=0, patch_visible_weight=0.5,
                           momentum_base=0.9, **OPTIM)


METHODS: dict[str, tuple[Callable[[], SSLMethod], tuple[int, ...]]] = {
    "moco_v2_plus": (lambda: MoCoV2Plus(_convnet(), queue_size=16, momentum_base=0.9, **HEADS,
                                        **OPTIM), (8, 8)),
    "fastsiam": (lambda: FastSiam(_convnet(), num_views=3, predictor_hidden_dim=8,
                                  head_batch_norm=False, **HEADS, **OPTIM), (8, 8, 8)),
    "nnsiam": (lambda: NNSiam(_convnet(), queue_size=16, predictor_hidden_dim=8,
                              head_batch_norm=False, **HEADS, **OPTIM), (8, 8)),
    "nnbyol": (lambda: NNBYOL(_convnet(), queue_size=16, head_batch_norm=False,
                              momentum_base=0.9, **HEADS, **OPTIM), (8, 8)),
    "directclr": (lambda: DirectCLR(_convnet(), loss_dim=5, temperature=0.2, **OPTIM), (8, 8)),
    "ibot_plus_plus": (_ibot, (16, 16)),
    "ressl": (lambda: ReSSL(_convnet(), queue_size=16, momentum_base=0.9, **HEADS, **OPTIM),
              (8, 8)),
    "all4one": (_all4one, (8, 8)),
    "all4one_local_statistics": (lambda: _all4one(_LocalStatisticsAll4One), (8, 8)),
    "deepcluster_v2": (lambda: DeepClusterV2(_convnet(), num_prototypes=(5, 3),
                                             kmeans_iterations=3, head_batch_norm=False,
                                             init_bank="forward", **HEADS, **OPTIM),
                       (8, 8, 4)),
    # groups reset by k-means over the bank at step 2 (of 3), momentum-updated at every step
    "smog": (lambda: SMoG(_convnet(), num_groups=4, reset_every=2, queue_size=16,
                          kmeans_iterations=3, head_batch_norm=False, momentum_base=0.9,
                          **HEADS, **OPTIM), (8, 8)),
    "smog_local_groups": (lambda: _LocalGroupsSMoG(
        _convnet(), num_groups=4, reset_every=2, queue_size=16, kmeans_iterations=3,
        head_batch_norm=False, momentum_base=0.9, **HEADS, **OPTIM), (8, 8)),
    "nnsiam_local_support": (lambda: _LocalSupportSetNNSiam(
        _convnet(), queue_size=16, predictor_hidden_dim=8, head_batch_norm=False, **HEADS,
        **OPTIM), (8, 8)),
    "deepcluster_v2_local_kmeans": (lambda: _LocalKMeansDeepClusterV2(
        _convnet(), num_prototypes=(5, 3), kmeans_iterations=3, head_batch_norm=False,
        **HEADS, **OPTIM), (8, 8, 4)),
    "deepcluster_v2_local_init": (lambda: _LocalInitDeepClusterV2(
        _convnet(), num_prototypes=(5, 3), kmeans_iterations=3, head_batch_norm=False,
        **HEADS, **OPTIM), (8, 8, 4)),
}
KNOWN_BAD = ("nnsiam_local_support", "all4one_local_statistics", "deepcluster_v2_local_kmeans",
             "deepcluster_v2_local_init", "smog_local_groups")
#: Methods that read each sample's dataset index from its seed (KeyedViews batches).
KEYED = ("deepcluster_v2", "deepcluster_v2_local_kmeans", "deepcluster_v2_local_init")


def _fit(name: str, batch_size: int, world: int, order: list[int] | None = None) -> dict:
    make, sizes = METHODS[name]
    pl.seed_everything(0, verbose=False)
    model = make()
    data: Any = (KeyedViews if name in KEYED else PrecomputedViews)(SAMPLES, sizes)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        precision="64-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=TensorDataModule(
        data if order is None else Subset(data, order), batch_size))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"model": state, "loss": float(trainer.callback_metrics["train/loss_epoch"])}


def _kmeans(rank: int, world: int) -> Tensor:
    """Centroids of spherical k-means on this rank's rows ``rank::world`` of a float64 bank."""
    bank = torch.randn(30, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return spherical_kmeans(bank[rank::world], initial_centroids(bank, 5, seed=1), iterations=4)


def _worker(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    return {"kmeans": _kmeans(rank, world), **{name: _fit(name, BATCH, world) for name in METHODS}}


def _differences(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> dict[str, float]:
    """Entries differing by more than 1e-9 -> their largest difference."""
    problems = {}
    for key, want in expected.items():
        if key == "shuffle_step":  # MoCo's shuffle-BN counter only moves under DDP
            continue
        got = actual[key]
        if key.endswith(".queue"):  # contents: the slots follow the enqueue order
            got, want = queue_contents(got), queue_contents(want)
        if got.shape != want.shape:  # DeepCluster's bank is sized when fit starts
            problems[key] = float("inf")
            continue
        difference = float((got.double() - want.double()).abs().max())
        if difference > 1e-9:
            problems[key] = difference
    return problems


@pytest.fixture(scope="module")
def runs() -> tuple[list[dict], dict]:
    ranks = run_in_processes(_worker, 2)
    order = ddp_global_order(SAMPLES, 2, BATCH, sampler_order=True)
    single = {name: _fit(name, 2 * BATCH, 1, order) for name in METHODS if name not in KNOWN_BAD}
    single["kmeans"] = _kmeans(0, 1)
    return ranks, single


@pytest.mark.parametrize("name", [n for n in METHODS if n not in KNOWN_BAD])
def test_two_processes_equal_one_process(runs, name: str) -> None:
    ranks, single = runs
    pl.seed_everything(0, verbose=False)
    initial = METHODS[name][0]().state_dict()
    moved = _differences(single[name]["model"], initial)
    assert any(not k.startswith("teacher") for k in moved)  # training happened
    queues = [k for k in initial if k.endswith(".queue")]
    assert all(k in moved for k in queues), "a queue kept its initial content"
    for rank in ranks:
        assert not _differences(rank[name]["model"], single[name]["model"])
        assert rank[name]["loss"] == pytest.approx(single[name]["loss"], abs=1e-9)


def test_per_rank_support_set_is_caught(runs) -> None:
    ranks, single = runs
    problems = _differences(ranks[0]["nnsiam_local_support"]["model"], single["nnsiam"]["model"])
    assert "support_set.queue" in problems, problems


def test_per_rank_feature_statistics_are_caught(runs) -> None:
    ranks, single = runs
    problems = _differences(ranks[0]["all4one_local_statistics"]["model"],
                            single["all4one"]["model"])
    assert any(k.startswith("projector") for k in problems), problems


def test_kmeans_on_row_shares_equals_one_process(runs) -> None:
    ranks, single = runs
    for rank in ranks:
        assert float((rank["kmeans"] - single["kmeans"]).abs().max()) < 1e-12


def test_local_kmeans_is_caught(runs) -> None:
    ranks, single = runs
    problems = _differences(ranks[0]["deepcluster_v2_local_kmeans"]["model"],
                            single["deepcluster_v2"]["model"])
    assert "assignments" in problems and "prototypes.0.layer.weight" in problems, problems


def test_local_initial_bank_is_caught(runs) -> None:
    ranks, single = runs
    problems = _differences(ranks[0]["deepcluster_v2_local_init"]["model"],
                            single["deepcluster_v2"]["model"])
    assert "assignments" in problems and "prototypes.0.layer.weight" in problems, problems


def test_smog_local_groups_are_caught(runs) -> None:
    ranks, single = runs
    problems = _differences(ranks[0]["smog_local_groups"]["model"], single["smog"]["model"])
    assert "groups" in problems and "bank.queue" in problems, problems
