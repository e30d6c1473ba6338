"""Exact-resume harness: fit every method on a tiny image folder with the real data
modules and random augmentations, in a process of its own.

The tests start it with :func:`start` (a process forked from a fork server that imported this
module once, so a harness process starts in milliseconds and shares nothing with the others);
``python tests/resume_harness.py jobs.json`` runs it by hand. A job list holds jobs
``{"method", "data_root", "workers", "epochs", "out", "ckpt_dir", "resume", "device_views",
"views_on", "shards", "cache_dir", "devices", "expect_error", "epoch_ckpt_dir"}``.
``device_views``: the batched ``DeviceViews`` path, made ``views_on`` the device or the
workers; ``shards``: a folder (or a URL, cached in ``cache_dir``) with the ``train`` and
``test`` shard folders of ``data_root``, read by ``StreamingDataModule``; ``devices``: 2 runs
``ddp_fork`` on 2 processes forked from the harness (its imports done; a spawned rank would
import everything again, and its loader workers would be spawned too), whose dump holds rank
0's model only; ``expect_error``: the fit must raise a ``ValueError``, whose message is dumped
as ``error``; ``epoch_ckpt_dir``: a checkpoint at the end of every epoch (``epoch=N.ckpt``).
``ckpt_dir`` writes a checkpoint after every optimizer step (``step=N.ckpt``), ``resume``
continues from one. ``preempt_dir`` adds :class:`PreemptionCheckpoint` there and, from step
``wait_step`` on, writes ``<out>.waiting`` and holds each step until a signal arrived (the test
sends SIGTERM then). Each job ``torch.save``s its final state to ``out``: model, optimizer and
scheduler states, every callback's state (online probe, kNN, the method's EMA callback, ...;
not the checkpoint writers'), the last logged metrics and the global step.
Every fit calls ``seed_everything(0)`` first, as the CLI does.

``method`` is any registered method (``ssl_lightning/methods/registry.py``: its small instance
on views of its registry crop sizes) or a name of :data:`TUNED` (instances tuned for a resume
check of their own, on 16 px views, and the known-bad variants); a tuned name wins.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.callbacks import KNNCallback, OnlineProbe, PreemptionCheckpoint
from ssl_lightning.data import (
    BYOLViews,
    DeviceViews,
    GramCropViews,
    ImageFolderDataModule,
    LinearEvalTransform,
    LocatedViews,
    MultiCropViews,
    MultiViewTransform,
    SimCLRViews,
    StreamingDataModule,
)
from ssl_lightning.evaluation import LinearEval
from ssl_lightning.methods import (
    AIM,
    BYOL,
    DINO,
    IBOT,
    MSN,
    PMSN,
    BarlowTwins,
    DeepClusterV2,
    DINOv3,
    Distillation,
    MoCoV2,
    MoCoV3,
    SimCLR,
    SimMIM,
    SimSiam,
    SMoG,
    SwAV,
    VICReg,
)
from ssl_lightning.methods.registry import method_entries, method_entry

SIZE = 16  # crop side of the training views of the tuned instances
OPT = dict(optimizer="sgd", lr=0.3, lr_scaling="none", warmup_epochs=0.5, image_size=SIZE)
#: The registered small instances' settings (their own image size).
REGISTERED_OPT = {k: v for k, v in OPT.items() if k != "image_size"}


def _net() -> SmallConvNet:
    return SmallConvNet((4, 8), norm="group")


def _vit(**kwargs: Any) -> ViT:
    return ViT(image_size=SIZE, patch_size=4, embed_dim=8, depth=1, num_heads=2,
               drop_path_rate=0.5, **kwargs)


class _InitStreamAIM(AIM):
    """Known-bad: prefixes from a generator made in ``__init__``, outside the checkpoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generator = torch.Generator().manual_seed(0)

    def draw_prefix(self, batch: int) -> torch.Tensor:
        low, high = self.prefix_range
        return torch.randint(low, high + 1, (batch,), generator=self.generator)


class _UnsavedAssignmentsDeepClusterV2(DeepClusterV2):
    """Known-bad: the epoch's k-means assignments kept outside the checkpoint (a plain
    attribute), so a run resumed inside an epoch starts from blank assignments."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        checkpoint["state_dict"]["assignments"].zero_()


class _UnsavedGroupsSMoG(SMoG):
    """Known-bad: the group features kept outside the checkpoint, so a resumed run starts from
    the groups its constructor drew."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        checkpoint["state_dict"]["groups"].copy_(self.groups)


#: Instances tuned for a resume check of their own (BatchNorm heads, stochastic depth, schedules
#: that cross an epoch) and the known-bad variants.
TUNED: dict[str, Callable[[], pl.LightningModule]] = {
    "simclr": lambda: SimCLR(_net(), projection_hidden_dim=8, projection_dim=4,
                             head_batch_norm=True, **OPT),
    "moco_v2": lambda: MoCoV2(_net(), projection_hidden_dim=8, projection_dim=4, queue_size=8,
                              momentum_base=0.9, **OPT),
    "moco_v3": lambda: MoCoV3(_net(), projection_hidden_dim=8, projection_dim=4,
                              projection_layers=2, momentum_base=0.9, **OPT),
    "byol": lambda: BYOL(_net(), projection_hidden_dim=8, projection_dim=4, momentum_base=0.9,
                         **OPT),
    "dino": lambda: DINO(_net(), head_out_dim=16, head_hidden_dim=8, head_bottleneck_dim=4,
                         warmup_teacher_temperature_epochs=1, freeze_last_layer_epochs=1, **OPT),
    "swav": lambda: SwAV(_net(), projection_hidden_dim=8, projection_dim=4, num_prototypes=6,
                         freeze_prototypes_steps=3, queue_size=8, queue_start_epoch=1, **OPT),
    "vicreg": lambda: VICReg(_net(), expander_hidden_dim=8, expander_dim=6,
                             **{**OPT, "lr": 0.02}),
    # VICRegL's small instance with position matching, on LocatedViews (below).
    "vicregl": lambda: method_entry("vicregl").small(_net(), position_matching=True,
                                                     **{**OPT, "lr": 0.02}),
    "barlow_twins": lambda: BarlowTwins(_net(), projection_hidden_dim=8, projection_dim=6, **OPT),
    "simsiam": lambda: SimSiam(_net(), projection_hidden_dim=8, projection_dim=6,
                               predictor_hidden_dim=4, **OPT),
    # Stochastic depth and block masks, drawn from the samples' seeds (the batch carries them).
    "ibot_vit": lambda: IBOT(ViT(image_size=SIZE, patch_size=4, embed_dim=8, depth=2, num_heads=2,
                                 drop_path_rate=0.5, mask_token=True), head_out_dim=16,
                             head_hidden_dim=8, head_bottleneck_dim=4,
                             warmup_teacher_temperature_epochs=1, **OPT),
    # Gram teacher snapshots at steps 1, 5 and 9 (resumed at 2 and at 9, before the refresh).
    "dinov3": lambda: DINOv3(ViT(image_size=SIZE, patch_size=4, embed_dim=8, depth=1, num_heads=2,
                                 mask_token=True), head_out_dim=16, patch_out_dim=12,
                             head_hidden_dim=8, head_bottleneck_dim=4, patch_hidden_dim=6,
                             patch_bottleneck_dim=4, num_local_crops=1,
                             warmup_teacher_temperature_epochs=1, gram_start_step=1,
                             gram_refresh_every=4, gram_max_refreshes=2, **OPT),
    # The teacher is built from the seeded RNG, so a resumed run rebuilds the same one.
    "distillation": lambda: Distillation(_net(), teacher=_net(), queue_size=8, **OPT),
    # SimMIM's masks and AIM's prefixes (and drop path) drawn from the samples' seeds.
    "simmim": lambda: SimMIM(_vit(mask_token=True), mask_patch_size=8, **OPT),
    "aim": lambda: AIM(_vit(), head_hidden_dim=8, head_layers=2, **OPT),
    "aim_init_stream": lambda: _InitStreamAIM(_vit(), head_hidden_dim=8, head_layers=2, **OPT),
    # Keyed token dropping of the anchor view, stochastic depth, prototypes, BatchNorm head.
    "msn": lambda: MSN(ViT(image_size=SIZE, patch_size=4, embed_dim=8, depth=2, num_heads=2,
                           drop_path_rate=0.5), projection_hidden_dim=8, projection_dim=4,
                       num_prototypes=6, mask_ratio=0.25, **OPT),
    "pmsn": lambda: PMSN(ViT(image_size=SIZE, patch_size=4, embed_dim=8, depth=2, num_heads=2,
                             drop_path_rate=0.5), projection_hidden_dim=8, projection_dim=4,
                         num_prototypes=6, mask_ratio=0.25, **OPT),
    # Bank written at the indices derived from the sample seeds, k-means at each epoch start.
    "deepcluster_v2": lambda: DeepClusterV2(_net(), projection_hidden_dim=8, projection_dim=4,
                                            num_prototypes=(5, 3), kmeans_iterations=3, **OPT),
    # Groups reset by k-means every 4 steps (resumed at 2 and at 9, between resets).
    "smog": lambda: SMoG(_net(), projection_hidden_dim=8, projection_dim=4, num_groups=3,
                         reset_every=4, queue_size=8, kmeans_iterations=3, momentum_base=0.9,
                         **OPT),
    "smog_unsaved": lambda: _UnsavedGroupsSMoG(
        _net(), projection_hidden_dim=8, projection_dim=4, num_groups=3, reset_every=4,
        queue_size=8, kmeans_iterations=3, momentum_base=0.9, **OPT),
    "deepcluster_v2_unsaved": lambda: _UnsavedAssignmentsDeepClusterV2(
        _net(), projection_hidden_dim=8, projection_dim=4, num_prototypes=(5, 3),
        kmeans_iterations=3, **OPT),
    "linear": lambda: LinearEval(_net(), num_classes=2, checkpoint="random", lr=0.1,
                                 lr_scaling="none", warmup_epochs=0.5, image_size=SIZE),
}
METHODS: dict[str, Callable[[], pl.LightningModule]] = {
    **{entry.name: lambda entry=entry: entry.small(**REGISTERED_OPT)
       for entry in method_entries()},
    **TUNED,
}


def registry_views(sizes: tuple[int, ...], weak_views: int = 0) -> MultiViewTransform:
    """Random views of a registry entry's crop sizes: equal sizes (the last ``weak_views`` of
    them weak, ReSSL's), 2 global + local crops, or DINOv3's 2 global + local + 2 Gram-teacher
    crops."""
    if len(set(sizes)) == 1:
        return SimCLRViews("cifar", num_views=len(sizes) - weak_views, crop_size=sizes[0],
                           weak_views=weak_views)
    local = [size for size in sizes[2:] if size < sizes[0]]
    gram = [size for size in sizes[2:] if size > sizes[0]]
    if gram:
        return GramCropViews(gram_size=gram[0], global_size=sizes[0], num_local_crops=len(local),
                             local_size=local[0])
    return MultiCropViews("dino", "cifar", num_local_crops=len(local), global_size=sizes[0],
                          local_size=local[0])


def transform(method: str, model: pl.LightningModule) -> MultiViewTransform:
    """The method's own kind of views (random), small."""
    if method not in TUNED:
        return registry_views(method_entry(method).views, model.hparams.get("weak_views", 0))
    if method in ("dino", "swav", "ibot_vit", "msn", "pmsn",
                  "deepcluster_v2", "deepcluster_v2_unsaved"):
        return MultiCropViews("swav" if method == "swav" else "dino", "cifar", num_local_crops=2,
                              global_size=SIZE, local_size=8)
    if method == "dinov3":
        return GramCropViews(gram_size=2 * SIZE, global_size=SIZE, num_local_crops=1,
                             local_size=8)
    if method in ("byol", "moco_v3"):
        return BYOLViews("cifar", crop_size=SIZE)
    if method == "vicregl":
        return LocatedViews("cifar", crop_size=SIZE)
    if method == "linear":
        return LinearEvalTransform("cifar", crop_size=SIZE)
    if method in ("distillation", "simmim", "aim", "aim_init_stream"):
        return SimCLRViews("cifar", num_views=1, crop_size=SIZE)
    return SimCLRViews("cifar", crop_size=SIZE)


class _WaitForSignal(pl.Callback):
    """From step ``step`` on, announce it in ``marker`` and hold until a signal was received."""

    def __init__(self, preemption: PreemptionCheckpoint, step: int, marker: str) -> None:
        self.preemption, self.step, self.marker = preemption, step, marker

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step < self.step:
            return
        Path(self.marker).write_text(str(trainer.global_step))
        deadline = time.monotonic() + 120
        while self.preemption.received is None and time.monotonic() < deadline:
            time.sleep(0.01)


def run(job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = METHODS[job["method"]]()
    root = job["data_root"]
    device = DeviceViews("cifar", crop_size=SIZE) if job.get("device_views") else None
    kind, root = ((StreamingDataModule, job["shards"]) if job.get("shards")
                  else (ImageFolderDataModule, root))
    cache = {"cache_dir": job["cache_dir"]} if job.get("cache_dir") else {}
    data = kind(
        f"{root}/train", f"{root}/test", preset="cifar", batch_size=4, num_workers=job["workers"],
        prefetch_factor=2, eval_batch_size=12, device_transform=device,
        batched_views_on=job.get("views_on", "auto"),
        train_transform=None if device is not None else transform(job["method"], model), **cache)
    callbacks: list[pl.Callback] = []
    if job["method"] != "linear":
        callbacks += [OnlineProbe(lr=0.2), KNNCallback(k=3)]
    if job.get("ckpt_dir"):
        callbacks.append(ModelCheckpoint(job["ckpt_dir"], filename="{step}", save_top_k=-1,
                                         every_n_train_steps=1))
    if job.get("epoch_ckpt_dir"):
        callbacks.append(ModelCheckpoint(job["epoch_ckpt_dir"], filename="{epoch}", save_top_k=-1,
                                         every_n_epochs=1, save_on_train_epoch_end=True))
    if job.get("preempt_dir"):  # first, as in the CLI's shared callbacks (before the probe)
        preemption = PreemptionCheckpoint(job["preempt_dir"])
        callbacks = [preemption, *callbacks,
                     _WaitForSignal(preemption, job["wait_step"], job["out"] + ".waiting")]
    devices = job.get("devices", 1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp_fork" if devices > 1 else "auto",
        max_epochs=job["epochs"], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(job.get("ckpt_dir") or job.get("epoch_ckpt_dir")),
        callbacks=callbacks,
        default_root_dir=job.get("ckpt_dir") or job["out"] + ".dir", deterministic=True)
    if job.get("expect_error"):
        try:
            trainer.fit(model, data, ckpt_path=job.get("resume"))
        except ValueError as err:
            torch.save({"error": str(err)}, job["out"])
            return
        raise AssertionError(f"{job['out']}: the fit ran without the expected error")
    trainer.fit(model, data, ckpt_path=job.get("resume"))
    torch.save({
        "global_step": trainer.global_step,
        "model": model.state_dict(),
        "optimizer": [o.state_dict() for o in trainer.optimizers],
        "scheduler": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        # every callback's state, the method's own (EMA) included; not the checkpoint writers'
        "callbacks": {type(c).__name__: c.state_dict() for c in trainer.callbacks  # type: ignore[attr-defined]
                      if not isinstance(c, (ModelCheckpoint, PreemptionCheckpoint))},
        "metrics": {k: float(v) for k, v in trainer.logged_metrics.items()},
    }, job["out"])


def start(jobs: list[dict[str, Any]], stderr: Path) -> multiprocessing.process.BaseProcess:
    """A process running ``jobs`` in order, its standard error written to ``stderr``; its exit
    code is 0 when every job ran (the status of a ``SystemExit``, e.g. 143 after SIGTERM, else
    1 with the traceback in ``stderr``). It is forked from this test process's fork server,
    which imported this module (torch, Lightning, the package) once: fresh memory for every
    harness process, as a new interpreter, without paying the imports again. It runs with this
    process's current environment variables and working directory."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    process = context.Process(target=_run_all, args=(jobs, dict(os.environ), os.getcwd(),
                                                     str(stderr)))
    process.start()
    return process


def _run_all(jobs: list[dict[str, Any]], environ: dict[str, str], cwd: str,
             stderr: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # what a new interpreter's default is: loader workers and ddp_fork ranks are forked
    multiprocessing.set_start_method("fork", force=True)
    sys.stderr.flush()
    descriptor = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    for job in jobs:
        run(job)


if __name__ == "__main__":
    for spec in json.loads(open(sys.argv[1]).read()):
        run(spec)
