"""Capture the step where a run diverged, so that ``python -m ssl_lightning replay`` can run it
again exactly (docs/reliability.md, "When a run diverges").

The divergence guard (:mod:`ssl_lightning.training.divergence`) stops a run at a non-finite
loss before the backward pass; this callback adds two checks before the optimiser step (a
non-finite gradient; optionally a loss spike, a loss above ``spike_factor`` times the median
of the last ``spike_window`` losses) and, whichever check stops the run, writes the capture
folder (:mod:`ssl_lightning.io.capture`) before the error reaches the user.

What the step started from is kept cheaply: the weights and the optimiser state do not change
before the optimiser step, so only the buffers (queues, centres, batch-norm statistics,
prototypes kept as buffers) are copied at each batch start, into copies allocated once. A
parameter changed in place during the step before the update (by a method's own code) is
detected by its version counter and named in the manifest (``exact: false``), since its
starting value is gone.

Under DDP every rank writes its part (its samples' seeds, dataset indices and loss) into the
same folder and rank 0 the shared state; the checks are reduced over the ranks, so all of them
stop at the same step. ``python -m ssl_lightning fit`` adds the callback to every run; from
Python, pass ``Trainer(callbacks=[DivergenceCapture()])``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from ssl_lightning._lightning import full_checkpoint, pl
from ssl_lightning.data.seeding import sample_indices
from ssl_lightning.distributed.sharding import ShardedStrategy
from ssl_lightning.io import capture as files
from ssl_lightning.io.run_directory import run_directory
from ssl_lightning.training.divergence import TrainingDivergedError, check_finite_gradients


class DivergenceCapture(pl.Callback):
    """Write the diverging step's capture folder when the run stops on divergence.

    Args:
        check_gradients: Stop on a non-finite gradient before the optimiser step (not under
            16-mixed precision, whose gradient scaler skips such steps by design).
        spike_factor: Stop when the step's loss (mean over ranks) exceeds this multiple of the
            median of the last ``spike_window`` losses; None (default) disables the check.
        spike_window: Losses in the running median.
        spike_min_steps: Steps recorded before the spike check starts.
        dirname: Folder of the captures inside the run directory.
    """

    def __init__(self, check_gradients: bool = True, spike_factor: float | None = None,
                 spike_window: int = 100, spike_min_steps: int = 20,
                 dirname: str = files.CAPTURES_DIR) -> None:
        if spike_factor is not None and spike_factor <= 0:
            raise ValueError(f"spike_factor must be > 0 (or None), got {spike_factor}.")
        if spike_window < 1 or spike_min_steps < 1:
            raise ValueError(f"spike_window and spike_min_steps must be >= 1, got "
                             f"{spike_window} and {spike_min_steps}.")
        self.check_gradients = check_gradients
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self.spike_min_steps = spike_min_steps
        self.dirname = dirname
        self._losses: deque[float] = deque(maxlen=spike_window)
        self._pending_step: dict[str, Any] | None = None
        self._loss: Tensor | None = None
        self._buffers: dict[str, Tensor] = {}
        self._versions: dict[str, int] = {}
        self._gradients_ready = False

    # ----------------------------------------------------------------- per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """Remember the step's identity and samples, and copy the buffers it starts from."""
        seeds = batch[2] if isinstance(batch, list | tuple) and len(batch) > 2 else None
        self._pending_step = {"epoch": trainer.current_epoch, "batch": batch_idx,
                      "global_step": trainer.global_step, "seeds": seeds}
        self._loss = None
        self._gradients_ready = False
        if isinstance(trainer.strategy, ShardedStrategy):  # not captured (see on_exception)
            return
        buffers = dict(pl_module.named_buffers())
        if buffers.keys() != self._buffers.keys() or any(
                b.shape != self._buffers[k].shape or b.dtype != self._buffers[k].dtype
                or b.device != self._buffers[k].device for k, b in buffers.items()):
            self._buffers = {k: torch.empty_like(b) for k, b in buffers.items()}
        if buffers:
            torch._foreach_copy_(list(self._buffers.values()), list(buffers.values()))
        self._versions = {k: p._version for k, p in pl_module.named_parameters()}

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: Tensor) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """The gradient and spike checks, before the update is applied."""
        self._gradients_ready = True
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self.check_gradients and (scaler is None or not scaler.is_enabled()):
            check_finite_gradients(pl_module)
        if self.spike_factor is not None and self._loss is not None:
            self._check_spike(trainer)

    def _check_spike(self, trainer: pl.Trainer) -> None:
        loss = float(trainer.strategy.reduce(self._loss.float().reshape(1),  # type: ignore[union-attr]
                                             reduce_op="mean").item())
        history = list(self._losses)
        self._losses.append(loss)
        if len(history) < self.spike_min_steps:
            return
        median = statistics.median(history)
        if loss > self.spike_factor * median:  # type: ignore[operator]
            raise TrainingDivergedError(
                f"Training diverged: the loss spiked to {loss:.6g} at global step "
                f"{trainer.global_step} (epoch {trainer.current_epoch}), above "
                f"{self.spike_factor:g} x the median {median:.6g} of the last {len(history)} "
                "steps (DivergenceCapture's spike_factor). The step was not applied.")

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self._losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._losses.extend(float(x) for x in state_dict.get("losses", []))

    # ----------------------------------------------------------------- the capture
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Write the capture of the step that raised :class:`TrainingDivergedError` (every rank
        is here: the checks stop all ranks together) and name it in the error."""
        if not isinstance(exception, TrainingDivergedError) or self._pending_step is None \
                or exception.applied:  # the weights check: the step that started it is gone
            return
        if isinstance(trainer.strategy, ShardedStrategy):
            exception.args = (f"{exception.args[0]} (Sharded runs are not captured for "
                              "replay.)",)
            return
        if exception.loss is not None:
            self._loss = exception.loss
        folder = self._write(trainer, pl_module, str(exception))
        exception.args = (f"{exception.args[0]} The step is captured in {folder}; replay it "
                          f"with: python -m ssl_lightning replay {folder}",)

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> str:
        strategy = trainer.strategy
        run_dir = run_directory(trainer)
        rank = trainer.global_rank
        step = self._pending_step
        assert step is not None
        names: tuple[str, str] | None = None
        if rank == 0:
            temporary, final = files.new_capture_dir(run_dir, step["global_step"])
            names = (str(temporary), str(final))
        temporary_name, final_name = cast(tuple[str, str], strategy.broadcast(names))
        checkpoint = full_checkpoint(trainer)
        self._write_rank(trainer, temporary_name, rank)
        strategy.barrier("divergence_capture_ranks")
        if rank == 0:
            self._write_shared(trainer, pl_module, checkpoint, temporary_name, reason)
            files.finish(Path(temporary_name), Path(final_name))
        strategy.barrier("divergence_capture_done")
        return final_name

    def _write_rank(self, trainer: pl.Trainer, folder: str, rank: int) -> None:
        step = self._pending_step
        assert step is not None
        seeds = step["seeds"]
        record: dict[str, Any] = {"rank": rank, "sample_seeds": None, "dataset_indices": None}
        if isinstance(seeds, Tensor):
            seeds = seeds.detach().cpu()
            record["sample_seeds"] = seeds.tolist()
            dataset = _train_dataset(trainer)
            seed = getattr(_datamodule(trainer), "train_seed", None)
            if dataset is not None and seed is not None:
                record["dataset_indices"] = sample_indices(
                    seeds, int(seed), step["epoch"], len(dataset)).tolist()
        loss = None if self._loss is None else self._loss.detach().cpu()
        value = None if loss is None else float(loss)
        # strict JSON has no NaN / Infinity: a non-finite loss is written as text ("nan")
        record["loss"] = value if value is None or math.isfinite(value) else str(value)
        text, tensors = files.rank_files(rank)
        files.write_tensors(os.path.join(folder, tensors), {"loss": loss})
        files.write_json(os.path.join(folder, text), record)

    def _write_shared(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                      checkpoint: dict[str, Any], folder: str, reason: str) -> None:
        step = self._pending_step
        assert step is not None
        state = checkpoint["state_dict"]
        for name, value in self._buffers.items():  # the buffers as the step found them
            if name in state:
                state[name] = value.detach().cpu().clone()
        checkpoint["state_dict"] = {k: v.detach().cpu() for k, v in state.items()}
        changed = sorted(k for k, p in pl_module.named_parameters()
                         if p._version != self._versions.get(k, p._version))
        files.write_tensors(os.path.join(folder, files.STATE), checkpoint)
        written = [files.MANIFEST, files.STATE]
        if self._gradients_ready:
            grads = {k: p.grad.detach().cpu() for k, p in pl_module.named_parameters()
                     if p.grad is not None}
            files.write_tensors(os.path.join(folder, files.GRADIENTS), grads)
            written.append(files.GRADIENTS)
        config = _resolved_config(trainer)
        if config is not None:
            from ssl_lightning.callbacks.artifacts import write_text

            write_text(os.path.join(folder, files.CONFIG), config)
            written.append(files.CONFIG)
        written += [name for r in range(trainer.world_size) for name in files.rank_files(r)]
        datamodule = _datamodule(trainer)
        dataset = _train_dataset(trainer)
        files.write_json(os.path.join(folder, files.MANIFEST), {
            "format": files.FORMAT,
            "reason": reason,
            "step": {k: step[k] for k in ("epoch", "batch", "global_step")},
            "world_size": trainer.world_size,
            "batch_size": getattr(datamodule, "batch_size", None),
            "gradients": self._gradients_ready,
            "exact": not changed, "changed_in_place": changed,
            "method": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            "data": {"class": None if datamodule is None else
                     f"{type(datamodule).__module__}.{type(datamodule).__qualname__}",
                     "seed": getattr(datamodule, "train_seed", None),
                     "dataset_size": None if dataset is None else len(dataset)},
            "trainer": {"accelerator": trainer.strategy.root_device.type,
                        "precision": str(trainer.precision),
                        "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps,
                        "limit_train_batches": trainer.limit_train_batches,
                        "accumulate_grad_batches": trainer.accumulate_grad_batches,
                        "gradient_clip_val": trainer.gradient_clip_val,
                        "gradient_clip_algorithm": trainer.gradient_clip_algorithm},
            "batch_norm": _batch_norm(pl_module),
            "environment": files.environment(str(trainer.precision)),
            "files": written,
        })


def _datamodule(trainer: pl.Trainer) -> Any:
    """The fit's data module (None when the loaders were passed directly)."""
    return getattr(trainer, "datamodule", None)


def _train_dataset(trainer: pl.Trainer) -> Any:
    """The data module's training dataset (None for other data sources)."""
    return getattr(_datamodule(trainer), "train_dataset", None)


def _batch_norm(module: torch.nn.Module) -> str:
    """``"sync"``, ``"per-rank"`` (batch statistics of each rank's own samples) or ``"none"``."""
    kinds = {isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    return "none" if not kinds else "per-rank" if False in kinds else "sync"


def _resolved_config(trainer: pl.Trainer) -> str | None:
    """The run's resolved config (the CLI's, as its config saver writes it), None outside the
    CLI."""
    from ssl_lightning._lightning import SaveConfigCallback

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, SaveConfigCallback):
            return callback.parser.dump(callback.config, skip_none=False)
    return None
