"""LeJEPA, TiCo, MMCR, W-MSE and VIbCReg trained by Lightning on 2 CPU processes (strategy ddp,
gloo, ``precision="64-true"``) end with the weights and buffers of one process fed the global
batch in the sampler's order, to 1e-9 (float64; the runs differ only by summation order, ~1e-15).

One spawn serves every method (and its known-bad variants): the two processes join one gloo
group and run a Trainer per method in it, as ``tests/product_matrix.py`` does for the configs.
Each known-bad variant must differ from the single-process run:

- LeJEPA with a plain ``dist.all_reduce`` of the SIGReg sums (lightly#1920): the SIGReg
  gradient is 1/world_size of the true one;
- LeJEPA with directions drawn per rank: every rank tests other projections;
- TiCo with its running covariance updated from the local batch (not the gathered one);
- MMCR with a centroid gather whose backward keeps only this rank's slice;
- W-MSE with sub-batch permutations drawn per rank (the ranks whiten different sub-batches);
- VIbCReg with IterNorm's statistics from each rank's own batch (``sync=False``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from distributed_utils import run_in_processes
from torch import Tensor
from torch.utils.data import Dataset, Subset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.distributed import all_gather_no_grad
from ssl_lightning.heads import IterNorm
from ssl_lightning.losses.mmcr import centroids
from ssl_lightning.losses.sigreg import sigreg_directions
from ssl_lightning.methods import MMCR, WMSE, LeJEPA, SSLMethod, TiCo, VIbCReg
from ssl_lightning.methods.wmse import WHITENING_STREAM
from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule, ddp_global_order

pytestmark = pytest.mark.slow

BATCH, STEPS, SAMPLES, TOLERANCE = 4, 3, 24, 1e-9
OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0, weight_decay=1e-4)


def plain_all_reduce(x: Tensor) -> Tensor:
    """Known-bad: a non-autograd all_reduce (the backward keeps only the local share)."""
    summed = x.clone()
    if dist.is_initialized():
        dist.all_reduce(summed)
    return summed


class _PlainAllReduceLeJEPA(LeJEPA):
    """Known-bad (lightly#1920): SIGReg's cos/sin sums summed by a plain all_reduce."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z = outputs["z"]
        return self.criterion(z, self.sigreg_directions(z.shape[-1], z), plain_all_reduce)


class _PerRankDirectionsLeJEPA(LeJEPA):
    """Known-bad: SIGReg directions drawn from a per-rank stream."""

    def sigreg_directions(self, dim: int, like: Tensor) -> Tensor:
        generator = torch.Generator().manual_seed(self.global_rank)
        return sigreg_directions(dim, self.hparams["num_slices"], generator, like.device,
                                 like.dtype)


class _LocalCovarianceTiCo(TiCo):
    """Known-bad: the running covariance follows this rank's batch only."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        return self.criterion(outputs["z_a"], outputs["z_b"])


class _LocalGradientMMCR(MMCR):
    """Known-bad: the gathered centroids carry a gradient only in this rank's own slice."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z = outputs["z"]
        local = centroids(z)
        everything = all_gather_no_grad(local.detach())
        start = self.global_rank * len(local)
        c_all = torch.cat([everything[:start], local, everything[start + len(local):]])
        return self.criterion(z, c_all)


class _PerRankSplitWMSE(WMSE):
    """Known-bad: the sub-batch permutation comes from a per-rank stream."""

    def step_generator(self, stream: int) -> torch.Generator:
        assert stream == WHITENING_STREAM
        return torch.Generator().manual_seed(self.global_rank)


class _LocalIterNormVIbCReg(VIbCReg):
    """Known-bad: IterNorm whitens each rank's batch by its own statistics."""

    def default_expander(self, hidden_dim: int, out_dim: int, layers: int,
                         batch_norm: bool) -> torch.nn.Module:
        expander = super().default_expander(hidden_dim, out_dim, layers, batch_norm)
        for module in expander.modules():
            if isinstance(module, IterNorm):
                module.sync = False
        return expander


def _backbone() -> SmallConvNet:
    return SmallConvNet((4, 8), norm="group")  # BatchNorm-free: exact under DDP


def _lejepa(cls: type[LeJEPA] = LeJEPA) -> Callable[[], SSLMethod]:
    return lambda: cls(_backbone(), projection_hidden_dim=16, projection_dim=8,
                       head_batch_norm=False, num_slices=16, **OPTIM)


def _tico(cls: type[TiCo] = TiCo) -> Callable[[], SSLMethod]:
    return lambda: cls(_backbone(), projection_hidden_dim=16, projection_dim=8,
                       head_batch_norm=False, momentum_base=0.9, **OPTIM)


def _mmcr(cls: type[MMCR] = MMCR) -> Callable[[], SSLMethod]:
    return lambda: cls(_backbone(), projection_hidden_dim=16, projection_dim=8,
                       head_batch_norm=False, lambda_views=0.1, **OPTIM)


def _wmse(cls: type[WMSE] = WMSE) -> Callable[[], SSLMethod]:
    return lambda: cls(_backbone(), projection_hidden_dim=16, projection_dim=3,
                       head_batch_norm=False, whitening_size=4, whitening_iters=2, **OPTIM)


def _vibcreg(cls: type[VIbCReg] = VIbCReg) -> Callable[[], SSLMethod]:
    return lambda: cls(_backbone(), expander_hidden_dim=16, expander_dim=8,
                       head_batch_norm=False, iternorm_groups=2, invariance_weight=1.0,
                       variance_weight=1.0, covariance_weight=1.0, **OPTIM)


#: name -> (model factory, view sizes, must equal the single-process run)
CASES: dict[str, tuple[Callable[[], SSLMethod], tuple[int, ...], bool]] = {
    "lejepa": (_lejepa(), (8, 8, 4, 4), True),
    "lejepa_plain_all_reduce": (_lejepa(_PlainAllReduceLeJEPA), (8, 8, 4, 4), False),
    "lejepa_per_rank_directions": (_lejepa(_PerRankDirectionsLeJEPA), (8, 8, 4, 4), False),
    "tico": (_tico(), (8, 8), True),
    "tico_local_covariance": (_tico(_LocalCovarianceTiCo), (8, 8), False),
    "mmcr": (_mmcr(), (8, 8, 8), True),
    "mmcr_local_gradient": (_mmcr(_LocalGradientMMCR), (8, 8, 8), False),
    "wmse": (_wmse(), (8, 8), True),
    "wmse_per_rank_split": (_wmse(_PerRankSplitWMSE), (8, 8), False),
    "vibcreg": (_vibcreg(), (8, 8), True),
    "vibcreg_local_iternorm": (_vibcreg(_LocalIterNormVIbCReg), (8, 8), False),
}


def _fit(make: Callable[[], SSLMethod], data: Dataset, batch_size: int, devices: int
         ) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = make()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        precision="64-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=TensorDataModule(data, batch_size))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    """Every case in the process group that ``run_in_processes`` set up (Lightning's DDP
    strategy finds it initialised and the torchrun-style variables tell it the layout)."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0")
    return {name: _fit(make, PrecomputedViews(SAMPLES, sizes), BATCH, world)
            for name, (make, sizes, _) in CASES.items()}


def _relative_difference(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Largest ``‖a − e‖ / max(‖e‖, 1)`` over the floating-point tensors (absolute for tensors
    near 0, such as IterNorm's running mean of centred outputs)."""
    worst = 0.0
    for key, e in expected.items():
        if e.is_floating_point() and e.numel():
            worst = max(worst, float((actual[key] - e).norm() / max(float(e.norm()), 1.0)))
        else:
            assert torch.equal(actual[key], e), key
    return worst


def make_runs() -> tuple[list[dict], dict[str, dict[str, Tensor]], dict[str, dict[str, Tensor]]]:
    ranks = run_in_processes(_worker, 2)
    order = ddp_global_order(SAMPLES, 2, BATCH, sampler_order=True)
    single, initial = {}, {}
    for name, (make, sizes, good) in CASES.items():
        if good:
            data = Subset(PrecomputedViews(SAMPLES, sizes), order)
            single[name] = _fit(make, data, 2 * BATCH, 1)
            torch.manual_seed(0)
            initial[name] = {k: v.double() for k, v in make().state_dict().items()}
    return ranks, single, initial


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[2]])
def test_two_processes_equal_one_process(name: str, runs) -> None:
    ranks, single, initial = runs
    assert _relative_difference(single[name], initial[name]) > 1e-3  # training moved weights
    for rank_state in ranks:
        assert _relative_difference(rank_state[name], single[name]) < TOLERANCE


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if not case[2]])
def test_known_bad_variant_differs(name: str, runs) -> None:
    ranks, single, _ = runs
    reference = single[name.split("_")[0]]
    difference = _relative_difference(ranks[0][name], reference)
    assert difference > 1e3 * TOLERANCE, f"{name}: {difference:.2e}"
