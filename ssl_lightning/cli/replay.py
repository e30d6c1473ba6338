"""``python -m ssl_lightning replay CAPTURE_DIR``: run a captured diverging step again and say
where it went wrong (docs/reliability.md, "When a run diverges").

The data module and the method are rebuilt from the capture's config, the state before the
step is restored through Lightning's resume (``state.ckpt``, loaded with ``weights_only``), and
the loader is placed at the captured batch: its samples are drawn again from their seeds, so
no copy of the images is needed while the data folder is at hand. The step runs up to the
optimiser step (which is not applied) with every module hooked
(:class:`~ssl_lightning.training.step_probe.StepProbe`). A DDP capture replays on one process
with the global batch (in the samplers' order), which the package's "2 processes = 1 process"
guarantee makes the same step.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from ssl_lightning._lightning import pl
from ssl_lightning.cli.quiet import quiet_known_warnings
from ssl_lightning.cli.replay_report import ReplayReport, close, compare_gradients, same_bits
from ssl_lightning.io import capture as files
from ssl_lightning.optim import schedule_position
from ssl_lightning.training.divergence import guard_paused
from ssl_lightning.training.step_probe import (
    StepProbe,
    largest,
    nonfinite,
    parameter_gradient_norms,
)

PROG = "python -m ssl_lightning replay"


class ReplayError(ValueError):
    """The capture cannot be replayed (what is missing and what to do)."""


class _Replayed(Exception):
    """Raised after the replayed step's backward pass, so the update is never applied."""


# ----------------------------------------------------------------------------- building
def _instantiate(config_text: str) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The method and the data module of a resolved config (its ``model`` and ``data``)."""
    from jsonargparse import ArgumentError

    import ssl_lightning  # noqa: F401  (registers the short class names)
    from ssl_lightning._lightning import LightningArgumentParser

    config = yaml.safe_load(config_text) or {}
    if not isinstance(config, dict) or "model" not in config or "data" not in config:
        raise ReplayError("the config names no model and data (the sections of a "
                          "`python -m ssl_lightning fit` config).")
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(pl.LightningModule, "model", required=True)
    parser.add_subclass_arguments(pl.LightningDataModule, "data", required=True)
    try:
        parsed = parser.parse_object({"model": config["model"], "data": config["data"]})
        built = parser.instantiate_classes(parsed)
    except (ArgumentError, ImportError, TypeError, ValueError) as err:
        raise ReplayError(f"the config's model or data cannot be built ({err}); pass --config "
                          "with the run's fit config.") from err
    return built.model, built.data


def _build_data(datamodule: pl.LightningDataModule, dataset_size: int | None) -> None:
    """Build the training set (before the trainer, to say clearly when the data is not at
    hand or changed)."""
    try:
        datamodule.setup("fit")
    except (OSError, ValueError) as err:
        raise ReplayError(
            f"the training data of the run cannot be read ({err}). The replay draws the step's "
            "samples again from the data the config names, so it must be at hand there; "
            "restore it, or pass --config with its new location.") from err
    dataset = getattr(datamodule, "train_dataset", None)
    if dataset is not None and dataset_size is not None and len(dataset) != dataset_size:
        raise ReplayError(
            f"the training data changed: {len(dataset)} samples now, {dataset_size} when the "
            "step was captured, so the captured dataset indices name other images.")


def _sample_paths(dataset: Any, indices: list[int]) -> list[str]:
    """The file of each dataset index (datasets that list ``samples``), else ``#index``."""
    found = dataset
    while not hasattr(found, "samples") and hasattr(found, "dataset"):
        found = found.dataset
    samples = getattr(found, "samples", None)
    if not isinstance(samples, list):
        return [f"#{i}" for i in indices]
    return [str(samples[i][0]) for i in indices]


def _interleave(parts: list[list[int]]) -> list[int]:
    """Ranks' per-sample lists in the global batch's order (local ``j`` of rank ``r`` of ``W``
    at ``j * W + r``)."""
    return [part[j] for j in range(len(parts[0])) for part in parts]


class _Recorder(pl.Callback):
    """Places the loader at the captured batch, hooks the step, records it, and stops it
    before the optimiser step."""

    def __init__(self, step: dict[str, int], batch_size: int) -> None:
        self.step = step
        self.batch_size = batch_size
        self.probe = StepProbe()
        self.terms: dict[str, float] = {}
        self.seeds: Tensor | None = None
        self.views: list[Tensor] = []
        self.loss: Tensor | None = None
        self.grads: dict[str, Tensor] = {}
        self.schedules: dict[str, Any] = {}
        self.parameter_gradients: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Place the sampler at the captured batch (Lightning resumes the loops there, and
        iterates the loader after this hook)."""
        sampler = getattr(trainer.train_dataloader, "sampler", None)
        if not hasattr(sampler, "yielded"):
            raise ReplayError("the data module's training loader does not draw from an "
                              "EpochSampler (the package's data modules do): the captured "
                              "batch cannot be placed.")
        state = sampler.state_dict()  # type: ignore[union-attr]
        state.update(epoch=self.step["epoch"], yielded=self.step["batch"] * self.batch_size)
        sampler.load_state_dict(state)  # type: ignore[union-attr]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        reached = {"epoch": trainer.current_epoch, "batch": batch_idx,
                   "global_step": trainer.global_step}
        if reached != self.step:
            raise ReplayError(f"the replay reached {reached}, not the captured step "
                              f"{self.step}: the trainer settings differ from the run's.")
        views, _, *seeds = batch
        self.views = [v.detach().cpu() for v in views]
        self.seeds = seeds[0].detach().cpu() if seeds else None
        self.probe.attach(pl_module)
        log = pl_module.log

        def recording_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(value, Tensor | float | int):
                self.terms[name] = float(value.detach() if isinstance(value, Tensor) else value)
            log(name, value, *args, **kwargs)

        pl_module.log = recording_log  # type: ignore[method-assign]

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: Tensor) -> None:
        self.loss = loss.detach().cpu()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.probe.detach()
        self.grads = {k: p.grad.detach().cpu().clone() for k, p in pl_module.named_parameters()
                      if p.grad is not None}
        self.parameter_gradients = parameter_gradient_norms(pl_module)
        pl_module.on_before_optimizer_step(optimizer)  # the method's weight-decay schedule
        self.schedules = _schedules(trainer, pl_module, optimizer)
        raise _Replayed


def _schedules(trainer: pl.Trainer, pl_module: pl.LightningModule,
               optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Learning rate, weight decay, EMA momentum and temperatures at the step."""
    groups = optimizer.param_groups
    found: dict[str, Any] = {
        "learning rate": sorted({float(g["lr"]) for g in groups}),
        "weight decay": sorted({float(g.get("weight_decay", 0.0)) for g in groups}),
    }
    if "momentum" in groups[0]:
        found["optimizer momentum"] = sorted({float(g["momentum"]) for g in groups})
    position = schedule_position(trainer, trainer.global_step)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if callable(getattr(callback, "momentum", None)):
            found[f"EMA momentum ({type(callback).__name__})"] = float(
                callback.momentum(*position))  # type: ignore[attr-defined]
    for name, value in pl_module.hparams.items():
        if "temperature" in name and isinstance(value, int | float):
            found[name] = float(value)
    for name in ("teacher_temperature", "patch_teacher_temperature"):
        method = getattr(pl_module, name, None)
        if callable(method):
            found[f"{name} (epoch {trainer.current_epoch})"] = float(
                method(trainer.current_epoch))
    return found


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Without Lightning's set-up messages (devices, restoring) and its warning that the
    run's callbacks are absent (the replay needs none of them)."""
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch",
                                                    "lightning_fabric", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        quiet_known_warnings()
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _replay_checkpoint(state: dict[str, Any], datamodule: pl.LightningDataModule, seed: int,
                       folder: str) -> str:
    """The capture's state as a checkpoint to resume from: the data position is set by
    :class:`_Recorder` (the saved loader state may hold prefetched batches), so only the data
    seed is kept of the data module's state."""
    key = type(datamodule).__qualname__  # where Lightning keeps a data module's state
    if isinstance(state.get(key), dict):
        state[key] = {"seed": seed}
    fit_loop = state.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    fit_loop.pop("combined_loader", None)
    path = os.path.join(folder, "replay.ckpt")
    torch.save(state, path)
    return path


def _check_views_folder(folder: str) -> None:
    """``--dump-views`` must name a new or empty folder (nothing is overwritten)."""
    target = Path(folder)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ReplayError(f"--dump-views {folder!r} exists and is not an empty folder; name a "
                          "new folder.")


def _write_views(views: list[Tensor], folder: str) -> list[str]:
    """Each view of each sample as a PNG (min-max scaled per image) into ``folder``."""
    from torchvision.utils import save_image

    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for v, batch in enumerate(views):
        for i, image in enumerate(batch.float()):
            if image.dim() != 3:
                continue
            low, high = image.nan_to_num().min(), image.nan_to_num().max()
            scaled = (image.nan_to_num() - low) / (high - low).clamp_min(1e-12)
            path = target / f"sample{i:03d}_view{v}.png"
            save_image(scaled[:3], path)
            written.append(str(path))
    return written


# ----------------------------------------------------------------------------- the replay
def replay(capture: str | os.PathLike[str], precision: str | None = None,
           accelerator: str | None = None, config: str | os.PathLike[str] | None = None,
           dump_views: str | None = None) -> ReplayReport:
    """Run the captured step of ``capture`` again on one process and report on it.

    Args:
        capture: The capture folder (``<run directory>/divergence/step-<n>``).
        precision: Lightning precision of the replay (default: the run's); ``"64-true"``
            tells numerics from data.
        accelerator: ``"cpu"``, ``"gpu"``, ... (default: the run's, else the CPU).
        config: A config to rebuild the method and data module from instead of the capture's
            (a run not started by ``python -m ssl_lightning fit``, or data that moved).
        dump_views: A new folder to write the batch's views into as PNG images.

    Raises:
        ReplayError, CaptureError: what is missing or wrong, and what to do.
    """
    folder = Path(capture)
    manifest = files.read_manifest(folder)
    accumulated = manifest["trainer"]["accumulate_grad_batches"]
    if accumulated != 1:
        raise ReplayError(f"the run accumulated the gradients of {accumulated} batches per "
                          "optimiser step (accumulate_grad_batches); the replay runs steps of "
                          "one batch. (micro_batch_size, the exact way to a larger batch, "
                          "replays.)")
    if dump_views is not None:
        _check_views_folder(dump_views)
    step = manifest["step"]
    world = int(manifest["world_size"])
    parts = files.read_ranks(folder, world)
    state = files.read_tensors(folder / files.STATE)
    config_path = Path(config) if config is not None else folder / files.CONFIG
    if not config_path.is_file():
        raise ReplayError(f"{config_path} does not exist: the run was not started by `python -m "
                          "ssl_lightning fit`, so the capture holds no config; pass --config "
                          "with the run's method and data (a fit config).")
    model, datamodule = _instantiate(config_path.read_text(encoding="utf-8"))
    if manifest["batch_size"] is None:
        raise ReplayError("the run's training batches came from loaders passed to fit, not from "
                          "a data module; the replay draws the batch again from the package's "
                          "data modules (SSLDataModule).")
    local_batch = int(manifest["batch_size"])
    if hasattr(datamodule, "num_workers"):
        datamodule.num_workers = 0  # type: ignore[attr-defined]
    datamodule.batch_size = local_batch * world  # type: ignore[attr-defined]
    _build_data(datamodule, manifest["data"]["dataset_size"])
    trainer_settings = manifest["trainer"]
    precision = precision or trainer_settings["precision"]
    if precision.startswith("64"):
        model = model.double()
    if accelerator is None:
        accelerator = trainer_settings["accelerator"]
        if accelerator == "cuda":
            accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    recorder = _Recorder(step, local_batch * world)
    with tempfile.TemporaryDirectory(prefix="ssl-replay-") as work, _quiet_lightning():
        checkpoint = _replay_checkpoint(state, datamodule, int(manifest["data"]["seed"]), work)
        try:
            trainer = pl.Trainer(
                accelerator=accelerator, devices=1, precision=precision,  # type: ignore[arg-type]
                max_epochs=trainer_settings["max_epochs"],
                max_steps=trainer_settings["max_steps"],
                limit_train_batches=trainer_settings["limit_train_batches"],
                accumulate_grad_batches=trainer_settings["accumulate_grad_batches"],
                gradient_clip_val=trainer_settings["gradient_clip_val"],
                gradient_clip_algorithm=trainer_settings["gradient_clip_algorithm"],
                limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[recorder], default_root_dir=work)
        except (ImportError, ValueError) as err:  # Lightning's refusal of a precision / device
            raise ReplayError(f"--precision {precision} / --accelerator {accelerator}: {err}") \
                from err
        try:
            with guard_paused():
                trainer.fit(model, datamodule=datamodule, ckpt_path=checkpoint,
                            weights_only=True)
        except _Replayed:
            pass
    if recorder.seeds is None and recorder.loss is None:
        raise ReplayError("the replay ended before reaching the captured step (the trainer "
                          "settings in manifest.json end the run earlier).")
    report = _report(folder, manifest, parts, recorder, datamodule, precision,
                     trainer.strategy.root_device.type)
    if dump_views is not None:
        report.views_written = _write_views(recorder.views, dump_views)
    return report


def _report(folder: Path, manifest: dict[str, Any], parts: list[dict[str, Any]],
            recorder: _Recorder, datamodule: Any, precision: str,
            accelerator: str) -> ReplayReport:
    world = int(manifest["world_size"])
    captured_seeds = None if parts[0]["sample_seeds"] is None else _interleave(
        [p["sample_seeds"] for p in parts])
    replayed_seeds = None if recorder.seeds is None else recorder.seeds.tolist()
    same_samples = captured_seeds == replayed_seeds
    losses = [p["loss"] for p in parts if isinstance(p.get("loss"), Tensor)]
    captured_loss = None if not losses else losses[0] if world == 1 else torch.stack(
        [x.double() for x in losses]).mean()
    loss_equal = None
    same_precision = precision == manifest["trainer"]["precision"]
    # bitwise on the run's own layout and device; else to RELATIVE_TOLERANCE
    exact = world == 1 and accelerator == manifest["trainer"]["accelerator"]
    if captured_loss is not None and recorder.loss is not None and same_precision:
        loss_equal = same_bits(captured_loss, recorder.loss) if exact and \
            captured_loss.dtype == recorder.loss.dtype else close(captured_loss, recorder.loss)
    gradient_difference = None
    gradients_equal = None
    if manifest.get("gradients") and same_precision:
        captured = files.read_tensors(folder / files.GRADIENTS)
        gradient_difference, gradients_equal = compare_gradients(
            captured, recorder.grads, exact=exact)
    indices = None if parts[0]["dataset_indices"] is None else _interleave(
        [p["dataset_indices"] for p in parts])
    dataset = getattr(datamodule, "train_dataset", None)
    paths = [] if indices is None or dataset is None else _sample_paths(dataset, indices)
    return ReplayReport(
        capture=str(folder), step=manifest["step"], world_size=world, precision=precision,
        captured_precision=manifest["trainer"]["precision"], accelerator=accelerator,
        captured_accelerator=manifest["trainer"]["accelerator"], reason=manifest["reason"],
        same_samples=same_samples, captured_loss=captured_loss,
        loss=recorder.loss, loss_equal=loss_equal, gradient_difference=gradient_difference,
        gradients_equal=gradients_equal, exact_state=bool(manifest.get("exact", True)),
        batch_norm=manifest.get("batch_norm", "none"),
        terms=recorder.terms,
        first_nonfinite_output=recorder.probe.first_nonfinite_output,
        first_nonfinite_gradient=recorder.probe.first_nonfinite_gradient,
        nonfinite_outputs=len(nonfinite(recorder.probe.output_norms)),
        nonfinite_gradients=len(nonfinite(recorder.probe.gradient_norms)),
        largest_outputs=recorder.probe.largest_outputs(),
        largest_gradients=recorder.probe.largest_gradients(),
        largest_parameter_gradients=largest(recorder.parameter_gradients, 5),
        schedules=recorder.schedules, image_paths=paths)



def main(args: list[str] | None = None) -> ReplayReport:
    """``python -m ssl_lightning replay CAPTURE_DIR [options]``; prints the report."""
    from ssl_lightning.cli.errors import debug_mode

    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a captured diverging step again (written by a run that "
        "stopped on divergence, <run directory>/divergence/step-<n>) and report: whether it "
        "reproduces the captured loss and gradients, each loss term, the first module with a "
        "non-finite output or gradient, the largest norms per module, the schedules at the "
        "step and the batch's images.")
    parser.add_argument("capture", help="the capture folder")
    parser.add_argument("--precision", default=None,
                        help="replay precision, e.g. 64-true to tell numerics from data "
                             "(default: the run's)")
    parser.add_argument("--devices", type=int, default=1,
                        help="1 (the only value): a DDP capture replays on one process with "
                             "the global batch")
    parser.add_argument("--accelerator", default=None, help="default: the run's")
    parser.add_argument("--config", default=None,
                        help="rebuild the method and data from this fit config instead of the "
                             "capture's config.yaml (e.g. the data moved)")
    parser.add_argument("--dump-views", default=None, metavar="DIR",
                        help="write the batch's views as PNG images into this new folder")
    parsed = parser.parse_args(args)
    if parsed.devices != 1:
        parser.exit(2, f"error: --devices {parsed.devices}: a replay runs on one process "
                       "(--devices 1 replays a DDP capture with its global batch).\n")
    try:
        report = replay(parsed.capture, parsed.precision, parsed.accelerator, parsed.config,
                        parsed.dump_views)
    except (ReplayError, files.CaptureError) as err:
        if debug_mode():
            raise
        parser.exit(2, f"error: {err}\n")
    print(report.text())
    return report
