"""What a run is and what it produced, told on the console: a short summary when fit starts (or
resumes) and another when it ends, so a user needs neither TensorBoard nor checkpoint file names
to learn the kNN accuracy or the command that resumes the run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ssl_lightning._lightning import ModelCheckpoint, checkpoint_intervals, pl
from ssl_lightning.io import run_directory
from ssl_lightning.io.results import results_record, update_best, write_results

#: Metrics reported at the end of fit, in this order, when the run logged them.
REPORTED_METRICS = ("val/knn_top1", "val/probe_top1", "val/top1", "train/loss")


class RunSummary(pl.Callback):
    """Prints the run's summary at fit start and its results at fit end (global rank 0 only).

    Start: method, backbone and parameter counts, images found (labeled or not, classes),
    per-device and global batch, the peak (scaled) learning rate, steps per epoch and in all,
    precision, the run directory, where checkpoints go and how often; on resume, the step and
    epoch it continues from. End (of a finished fit): final and best kNN / probe top-1, the
    checkpoint paths, the exported backbone (a callback's ``exported_backbone`` path, e.g.
    :class:`~ssl_lightning.evaluation.ExportBackbone`'s) and the commands to resume and to
    evaluate. With a logger, it then writes ``results.json`` in the run directory
    (:mod:`ssl_lightning.io.results`, read by ``python -m ssl_lightning compare``).
    """

    def __init__(self) -> None:
        self.lines_at_start: list[str] = []
        self.lines_at_end: list[str] = []
        self._run_dir: str | None = None
        self._best: dict[str, float] = {}  # metric -> best value at a validation end

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run_dir = run_directory(trainer)  # a broadcast under DDP: read on every rank
        if not trainer.is_global_zero:
            return
        self.lines_at_start = start_lines(trainer, pl_module, self._run_dir)
        print("\n".join(self.lines_at_start), flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            update_best(self._best, trainer.callback_metrics)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """After every callback's ``on_fit_end`` (so the exported backbone exists); Lightning
        calls ``teardown`` only for a fit that finished, not one stopped by an error or a
        signal."""
        if stage != "fit" or not trainer.is_global_zero or self._run_dir is None:
            return
        pretraining = hasattr(pl_module, "forward_views")  # an SSLMethod, not an evaluation
        self.lines_at_end = end_lines(trainer, self._run_dir, suggest_evaluation=pretraining)
        print("\n".join(self.lines_at_end), flush=True)
        if trainer.loggers:  # a run directory of its own, not the working directory
            write_results(self._run_dir,
                          results_record(trainer, pl_module, self._run_dir, self._best))


def start_lines(trainer: pl.Trainer, module: pl.LightningModule, run_dir: str | None) -> list[str]:
    backbone = getattr(module, "backbone", None)
    lines = [f"== {type(module).__name__}"
             + (f" · backbone {type(backbone).__name__} ({_millions(backbone)} parameters)"
                if backbone is not None else "")
             + f" · {_millions(module, trainable=True)} trainable parameters in all"]
    lines += [f"   data: {_describe_data(trainer)}"]
    per_device = _per_device_batch(trainer)
    if per_device is not None:
        world = trainer.world_size * trainer.accumulate_grad_batches
        lines.append(f"   batch: {per_device} per device x {trainer.world_size} device(s)"
                     + (f" x {trainer.accumulate_grad_batches} accumulated"
                        if trainer.accumulate_grad_batches > 1 else "")
                     + f" = {per_device * world} global")
    peak = _peak_lr(trainer)
    steps = trainer.num_training_batches
    per_epoch = (f"{int(steps) // trainer.accumulate_grad_batches} steps per epoch, "
                 if steps != float("inf") else "")
    lines.append(f"   schedule: {per_epoch}{trainer.estimated_stepping_batches} steps in all"
                 + (f", peak lr {peak:.4g} (after lr scaling)" if peak is not None else "")
                 + f", precision {trainer.precision}")
    lines.append(f"   run directory: {run_dir}")
    lines += [f"   checkpoints: {line}" for line in _checkpoint_plan(trainer)]
    if trainer.ckpt_path:
        lines.append(f"   resuming from {trainer.ckpt_path}: {_position(trainer)}")
    return lines


def end_lines(trainer: pl.Trainer, run_dir: str | None,
              suggest_evaluation: bool = True) -> list[str]:
    metrics = trainer.callback_metrics
    lines = [f"== fit ended at step {trainer.global_step} (epoch {trainer.current_epoch})"]
    for name in REPORTED_METRICS:
        if name in metrics:
            lines.append(f"   {name}: {float(metrics[name]):.4g} (last)"
                         + _best(trainer, name))
    lines += _no_validation(trainer)
    last = _last_checkpoint(trainer)
    best = [cb.best_model_path for cb in _checkpoints(trainer) if cb.best_model_path]
    if last:
        lines.append(f"   last checkpoint: {last}")
    lines += [f"   best checkpoint: {path}" for path in dict.fromkeys(best)]
    exported = [cb.exported_backbone for cb in trainer.callbacks  # type: ignore[attr-defined]
                if getattr(cb, "exported_backbone", None)]
    lines += [f"   exported backbone: {path}" for path in exported]
    config = Path(run_dir) / "config.yaml" if run_dir else None
    if last and config is not None and config.is_file():
        lines.append("   resume: python -m ssl_lightning fit --config "
                     f"{shlex.quote(str(config))} --ckpt_path {shlex.quote(last)}")
        if suggest_evaluation:
            lines.append("   evaluate: python -m ssl_lightning fit --config linear "
                         f"--model.checkpoint {shlex.quote(last)}")
    return lines


def _no_validation(trainer: pl.Trainer) -> list[str]:
    """A line saying why no ``val/`` metric exists when the data has a validation split."""
    if (any(name.startswith("val/") for name in trainer.callback_metrics)
            or trainer.limit_val_batches == 0
            or getattr(trainer.datamodule, "eval_datasets", None) is None):  # type: ignore[attr-defined]
        return []
    every = trainer.check_val_every_n_epoch
    if every is not None and trainer.current_epoch < every:
        return [f"   no validation ran: check_val_every_n_epoch={every} and the run ended after "
                f"{trainer.current_epoch} epoch(s); --trainer.check_val_every_n_epoch 1 "
                "validates every epoch"]
    return ["   no validation metric was logged"]


def _millions(module: Any, trainable: bool = False) -> str:
    count = sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)
    return f"{count / 1e6:.2f}M" if count >= 10_000 else str(count)


def _per_device_batch(trainer: pl.Trainer) -> int | None:
    loader = trainer.train_dataloader
    return getattr(loader, "batch_size", None) if loader is not None else None


def _describe_data(trainer: pl.Trainer) -> str:
    loader = trainer.train_dataloader
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return "unknown"
    size = f"{len(dataset)} training images" if hasattr(dataset, "__len__") else "a stream"
    inner = dataset
    while not hasattr(inner, "classes") and hasattr(inner, "dataset"):
        inner = inner.dataset
    classes = getattr(inner, "classes", None)
    if classes:
        return f"{size}, labeled, {len(classes)} classes"
    root = getattr(inner, "root", None)
    return f"{size}, unlabeled" + (f" ({root})" if root is not None else "")


def _peak_lr(trainer: pl.Trainer) -> float | None:
    if trainer.lr_scheduler_configs:
        base = getattr(trainer.lr_scheduler_configs[0].scheduler, "base_lrs", None)
        if base:
            return float(base[0])
    if trainer.optimizers:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    return None


def _checkpoints(trainer: pl.Trainer) -> list[ModelCheckpoint]:
    return [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]  # type: ignore


def _checkpoint_plan(trainer: pl.Trainer) -> list[str]:
    plan = []
    for cb in _checkpoints(trainer):
        when = []
        every_n_train_steps, train_time_interval, every_n_epochs = checkpoint_intervals(cb)
        if every_n_train_steps:
            when.append(f"every {every_n_train_steps} steps")
        if train_time_interval is not None:
            when.append(f"every {train_time_interval}")
        if cb.monitor:
            when.append(f"the best {cb.monitor} ({cb.mode})")
        if not when and every_n_epochs:
            when.append(f"every {every_n_epochs} epoch(s)")
        last = " + last.ckpt" if cb.save_last else ""
        plan.append(f"{cb.dirpath}: {', '.join(when) or 'at epoch ends'}{last}")
    return list(dict.fromkeys(plan))


def _position(trainer: pl.Trainer) -> str:
    """Where the restored run stands, counted in the loader's batches (Lightning marks an epoch
    stopped by ``max_steps`` as completed, so its epoch counter is one ahead mid-epoch)."""
    total = trainer.num_training_batches
    if total == float("inf"):
        return f"continues at step {trainer.global_step}"
    epoch, batch = divmod(trainer.global_step * trainer.accumulate_grad_batches, int(total))
    where = f"batch {batch} of {int(total)}, mid-epoch" if batch else "at the epoch's start"
    return f"continues at step {trainer.global_step}, epoch {epoch} ({where})"


def _best(trainer: pl.Trainer, name: str) -> str:
    for cb in _checkpoints(trainer):
        if cb.monitor == name and cb.best_model_score is not None:
            return f", best {float(cb.best_model_score):.4g}"
    return ""


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    for cb in _checkpoints(trainer):
        if cb.last_model_path and Path(cb.last_model_path).exists():  # a sharded one: a folder
            return cb.last_model_path
    return None
