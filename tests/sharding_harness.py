"""Sharded (FSDP2) training of the methods: one pair of processes running many checks.

:data:`METHODS` is every registered method (``ssl_lightning/methods/registry.py``) that does not
opt out of ``sharded_equals_ddp`` (none does today), as its registry small instance on a ViT
(the ConvNet methods get :func:`~ssl_lightning.methods.registry.small_vit`; FSDP2 shards its
blocks) with the harness's :data:`SETTINGS`, plus the :data:`VARIANTS` that check something of
their own.

:func:`run_all` starts 2 CPU processes (forked from the fork server, see :func:`_spawn`).
Before joining a process group, rank r fits the single-process references (the global batch of
8 on one process) of every other method; then
both join one gloo group and every method is fitted with Lightning's DDP and with
:class:`~ssl_lightning.distributed.sharding.ShardedStrategy` inside that group (the product
matrix's trick: one start-up for all fits). Tiny ViTs (depth 1, width 16, 8 px), 24
precomputed samples (3 optimiser steps of 4 per rank), float64 through
``torch.set_default_dtype`` (Lightning refuses ``precision="64-true"`` for
``ModelParallelStrategy``; under ``32-true`` a float64 model and float64 data stay float64). Every
sample carries its seed (:class:`KeyedViews`, as the data modules' batches do), so the masks of
iBOT, DINOv2, MAE and I-JEPA are drawn per sample, the same on 1 process, under DDP and sharded.

The resume check uses the real image-folder data module (random augmentations, its stateful
loader) in fp32: a straight sharded run writes a distributed checkpoint after every step (3 per
epoch), a fresh pair of processes (:func:`run_resume`) resumes from step 2 (inside epoch 0; for
DINOv3 between its Gram-teacher snapshots at steps 1 and 3, see :data:`RESUMED`), then
one process resumes from step 3 (the shards re-split) and is refused step 2 (inside an epoch).
iBOT also runs with activation checkpointing. The known-bad variants run in the first spawn: a
teacher sharded as one unit while its student is sharded per block, and an EMA applied by rank 0
to gathered full copies.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import Subset

import ssl_lightning.callbacks.ema as ema_module
from ssl_lightning.backbones import ViT
from ssl_lightning.data import GramCropViews, ImageFolderDataModule, SimCLRViews
from ssl_lightning.distributed.sharding import ShardedStrategy
from ssl_lightning.methods import BYOL, DINOv3, SimCLR, VIbCReg
from ssl_lightning.methods.registry import method_entries, method_entry, small_convnet, small_vit
from ssl_lightning.testing.process_pool import free_port
from ssl_lightning.testing.trainer_runs import KeyedViews, TensorDataModule, ddp_global_order

SAMPLES, BATCH, WORLD, STEPS = 24, 4, 2, 3
OPT = dict(lr_scaling="none", warmup_epochs=0)
DINO_HEAD = dict(head_out_dim=32, head_hidden_dim=16, head_bottleneck_dim=8,
                 warmup_teacher_temperature_epochs=0, momentum_base=0.9)
MIM = dict(shared_head=False, patch_out_dim=24, mask_probability=0.5, num_local_crops=1)
#: DINOv3 trains with SGD here: AdamW's step divides the key bias's gradient (zero in exact
#: arithmetic, softmax ignores a shift of the keys; 1e-17 of rounding noise) by its own root mean
#: square, and the three runs then differ by 1.4e-9 (DDP) and 2.7e-9 (sharded) in that bias.
DINOV3_SGD = dict(optimizer="sgd", lr=0.05, clip_grad=0.5)


#: Methods whose decisions depend on a sample's place in the step (registered with
#: ``position_keyed``: DINOv2's stratified mask ratios, W-MSE's whitening sub-batches, SMoG's
#: bank fill, NeCo's reference shuffle, all keyed by the global sampler position): their one
#: process sees the samplers' order, where rank r's sample j is at j * WORLD + r. The others see
#: the rank batches concatenated, the order of the gathered batch (and of a queue, whose slots
#: are compared here directly).
BY_POSITION = frozenset(entry.name for entry in method_entries() if entry.position_keyed)


def vit(**kwargs: Any) -> ViT:
    """A 1-block ViT of width 16 on 16 px images (4 px patches unless given)."""
    return ViT(**{"image_size": 16, "patch_size": 4, "embed_dim": 16, "depth": 1,
                  "num_heads": 2, **kwargs})


#: Harness settings added to a registered method's small instance: no shuffled BatchNorm (a
#: collective of its own), DINOv3 with SGD (above), Distillation without mixup (it pairs samples
#: by sampler position, the queue holds the gathered rank-major order, and no one-process order
#: matches both; tests/distributed/test_distillation_ddp.py covers mixup).
SETTINGS: dict[str, dict[str, Any]] = {
    "moco_v2": dict(shuffle_bn=False),
    "moco_v2_plus": dict(shuffle_bn=False),
    "densecl": dict(shuffle_bn=False),
    "dinov3": DINOV3_SGD,
    "distillation": dict(mixup=False),
}


def _registered(name: str) -> Callable[[], pl.LightningModule]:
    entry = method_entry(name)
    backbone = small_vit if entry.backbone is small_convnet else entry.backbone
    return lambda: entry.small(backbone(), **OPT, **SETTINGS.get(name, {}))


#: Variants beyond the registry's small instances, with their views.
VARIANTS: dict[str, tuple[Callable[[], pl.LightningModule], tuple[int, ...]]] = {
    "ibot_plus_plus": (lambda: method_entry("ibot").small(patch_visible_weight=0.5, **OPT),
                       method_entry("ibot").views),
    # IterNorm on, loss weights 1: LARS and the recipe's weights (25, 25, 200) amplify
    # summation-order noise past the bound (1.8e-9; one process with each batch reversed
    # already differs by 5.4e-10).
    "vibcreg_iternorm": (lambda: VIbCReg(small_vit(), expander_hidden_dim=16, expander_dim=8,
                                         head_batch_norm=False, iternorm_groups=2,
                                         invariance_weight=1.0, variance_weight=1.0,
                                         covariance_weight=1.0, **OPT), (8, 8)),
}

#: Methods with BatchNorm in their heads, outside the one-process comparison (each process
#: normalises its own batch): sharded must hold DDP's running statistics on every rank (rank 0's
#: buffers broadcast before each step) and save rank 0's, as DDP's checkpoint does.
BATCHNORM: dict[str, Callable[[], pl.LightningModule]] = {
    "simclr_bn": lambda: SimCLR(vit(), projection_hidden_dim=16, projection_dim=8,
                                head_batch_norm=True, **OPT),
    "byol_bn": lambda: BYOL(vit(), projection_hidden_dim=16, projection_dim=8,
                            head_batch_norm=True, momentum_base=0.9, **OPT),
}

METHODS: dict[str, Callable[[], pl.LightningModule]] = {
    **{entry.name: _registered(entry.name) for entry in method_entries()
       if entry.opt_out("sharded_equals_ddp") is None},
    **{name: make for name, (make, _) in VARIANTS.items()},
}
#: The views of each method: its registry entry's, or its variant's.
VIEWS: dict[str, tuple[int, ...]] = {
    **{entry.name: entry.views for entry in method_entries()},
    **{name: views for name, (_, views) in VARIANTS.items()},
}


def make_method(name: str) -> pl.LightningModule:
    torch.manual_seed(0)
    return {**METHODS, **BATCHNORM}[name]()


def full_state(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The model's state with sharded tensors gathered (a collective under sharding)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _trainer(strategy: Any, devices: int, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False,
                                    num_sanity_val_steps=0, max_steps=STEPS)
    settings.update(kwargs)
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                      precision="32-true", **settings)


def fit_tensors(name: str, strategy: Any, devices: int, save_to: Path | None = None
                ) -> dict[str, torch.Tensor]:
    """Fit method ``name`` STEPS steps on the precomputed views (the global order on 1
    process) and return its full state; optionally save a checkpoint at the end."""
    data = KeyedViews(SAMPLES, VIEWS.get(name, (16, 16)), dtype=torch.float64)
    if devices == 1:
        data = Subset(data, ddp_global_order(SAMPLES, WORLD, BATCH,
                                             sampler_order=name in BY_POSITION))
    model = make_method(name)
    trainer = _trainer(strategy, devices)
    trainer.fit(model, TensorDataModule(data, BATCH * WORLD // devices))
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return full_state(model)


#: Methods of the image-folder resume check: DINO (EMA teacher, centre), DINOv3, whose Gram
#: teacher is snapshot at steps 1 and 3 (the resume from step 2 crosses the second snapshot), and
#: Distillation, whose frozen teacher is left out of the checkpoint (rebuilt, then checked).
RESUMED = ("dino", "dinov3_gram", "distillation")


def _resume_method(name: str) -> tuple[pl.LightningModule, Any]:
    """Method ``name`` of :data:`RESUMED` and its random views (8 px for the registered small
    instances; DINOv3's: 16 px, its Gram-teacher crops at 32 px)."""
    if name in ("dino", "distillation"):
        return make_method(name), SimCLRViews("cifar", crop_size=8,
                                              num_views=2 if name == "dino" else 1)
    torch.manual_seed(0)
    model = DINOv3(vit(mask_token=True), **DINO_HEAD, **MIM, patch_hidden_dim=12,
                   patch_bottleneck_dim=6, gram_start_step=1, gram_refresh_every=2,
                   gram_max_refreshes=1, image_size=16, **OPT)
    return model, GramCropViews(gram_size=32, global_size=16, num_local_crops=1, local_size=8)


def image_fit(root: Path, strategy: Any, max_steps: int, ckpt_dir: Path | None = None,
              resume: str | None = None, devices: int = WORLD, name: str = "dino"
              ) -> dict[str, Any]:
    """Method ``name`` of :data:`RESUMED` on the tiny image folder with random views, fp32;
    optionally a checkpoint after every step, or resumed from ``resume``."""
    pl.seed_everything(0, verbose=False)
    model, views = _resume_method(name)
    data = ImageFolderDataModule(str(root / "train"), str(root / "test"), preset="cifar",
                                 batch_size=BATCH, num_workers=0, train_transform=views)
    callbacks = [] if ckpt_dir is None else [ModelCheckpoint(
        str(ckpt_dir), filename="{step}", save_top_k=-1, every_n_train_steps=1)]
    trainer = _trainer(strategy, devices, max_steps=max_steps, callbacks=callbacks,
                       enable_checkpointing=ckpt_dir is not None,
                       default_root_dir=str(ckpt_dir or root), limit_val_batches=0)
    trainer.fit(model, data, ckpt_path=resume)
    return {"state": full_state(model), "global_step": trainer.global_step}


def _join(rank: int, port: int, world: int = WORLD) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _ema_of_gathered_on_rank0(pairs: Any, tau: float, buffer_policy: str = "copy") -> None:
    """Known-bad EMA: rank 0 averages gathered full copies; the teacher shards never change."""
    with torch.no_grad():
        for student, teacher in pairs:
            for s, t in zip(student.parameters(), teacher.parameters(), strict=True):
                full_s, full_t = s.full_tensor(), t.full_tensor()
                if dist.get_rank() == 0:
                    full_t.mul_(tau).add_(full_s, alpha=1 - tau)


def _teacher_wrapped_whole() -> str:
    """Known-bad wrapping: the student per block, the teacher as one unit; the message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ssl_lightning.distributed.sharding import check_same_sharding, shard_units

    model, mesh = make_method("dino"), init_device_mesh("cpu", (WORLD,))
    for unit in list(shard_units(model.backbone)):
        fully_shard(unit, mesh=mesh)
    for root in (model.backbone, model.teacher_backbone, model.head, model.teacher_head):
        fully_shard(root, mesh=mesh)
    try:
        check_same_sharding(model.ema_pairs())
    except ValueError as error:
        return str(error)
    return ""


def _equivalence_worker(rank: int, port: int, out: str, image_root: str) -> None:
    torch.set_num_threads(1)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    names = list(METHODS)
    result: dict[str, Any] = {"single": {n: fit_tensors(n, "auto", 1) for n in names[rank::2]}}
    _join(rank, port)
    try:
        result["ddp"] = {n: fit_tensors(n, "ddp", WORLD) for n in names}
        result["sharded"] = {n: fit_tensors(n, ShardedStrategy(), WORLD) for n in names}
        result["bn_ddp"] = {n: fit_tensors(n, "ddp", WORLD) for n in BATCHNORM}
        result["bn_sharded"] = {n: fit_tensors(n, ShardedStrategy(), WORLD,
                                               save_to=Path(image_root) / f"{n}.ckpt")
                                for n in BATCHNORM}
        result["checkpointed"] = fit_tensors("ibot", ShardedStrategy(activation_checkpointing=True),
                                             WORLD)
        result["bad_wrap"] = _teacher_wrapped_whole()
        good_ema, ema_module.ema_update_ = ema_module.ema_update_, _ema_of_gathered_on_rank0
        try:
            result["bad_ema"] = fit_tensors("dino", ShardedStrategy(), WORLD)
        finally:
            ema_module.ema_update_ = good_ema
        torch.set_default_dtype(default)
        root = Path(image_root)
        result["straight"] = image_fit(root, ShardedStrategy(), 4, ckpt_dir=root / "ckpt")
        for name in RESUMED[1:]:
            result[f"straight_{name}"] = image_fit(root, ShardedStrategy(), 4, name=name,
                                                   ckpt_dir=root / f"ckpt_{name}")
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _resume_worker(rank: int, port: int, out: str, image_root: str) -> None:
    torch.set_num_threads(1)
    root = Path(image_root)
    _join(rank, port)
    try:
        result = image_fit(root, ShardedStrategy(), 4, resume=str(root / "ckpt" / "step=2.ckpt"))
        for name in RESUMED[1:]:
            result[name] = image_fit(root, ShardedStrategy(), 4, name=name,
                                     resume=str(root / f"ckpt_{name}" / "step=2.ckpt"))
    finally:
        dist.destroy_process_group()
    if rank == 0:  # 1 process: the end of epoch 0 (step 3) reshards; inside it is refused
        _join(0, free_port(), world=1)
        try:
            result["one_process"] = image_fit(root, ShardedStrategy(), 4, devices=1,
                                              resume=str(root / "ckpt" / "step=3.ckpt"))
            try:
                image_fit(root, ShardedStrategy(), 4, devices=1,
                          resume=str(root / "ckpt" / "step=2.ckpt"))
                result["refused"] = ""
            except ValueError as error:
                result["refused"] = str(error)
        finally:
            dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _spawn(worker: Callable[..., None], image_root: Path) -> list[dict[str, Any]]:
    """``worker`` on :data:`WORLD` new processes, forked from the test process's fork server
    (which imported this module once: each process has fresh memory without importing torch,
    Lightning and the package again)."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(free_port(), out, str(image_root)), nprocs=WORLD,
                           start_method="forkserver")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True)
                for r in range(WORLD)]


def run_all(image_root: Path) -> list[dict[str, Any]]:
    """Every method single / DDP / sharded, and the straight sharded image-folder run."""
    return _spawn(_equivalence_worker, image_root)


def run_resume(image_root: Path) -> list[dict[str, Any]]:
    """The sharded image-folder run resumed from its step-2 checkpoint in fresh processes."""
    return _spawn(_resume_worker, image_root)
