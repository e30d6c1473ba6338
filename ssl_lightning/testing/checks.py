"""The exactness checks of the shipped methods, for one's own method in one's own test suite.

Each check trains a method built by ``make_method`` twice, in float64 on CPU, in two ways that
must give the same result, and raises :class:`AssertionError` naming every weight, buffer or
optimiser state that differs and by how much (relative):

- :func:`assert_micro_batches_equal_whole_batch`: whole batches vs ``micro_batch_size``
  (gradient caching): ``forward_views`` must not couple the samples of a batch.
- :func:`assert_two_processes_equal_one`: 2 gloo processes (Lightning DDP) vs 1 process fed the
  global batches in ``DistributedSampler``'s order: the loss gathers what it compares.
- :func:`assert_resume_is_exact`: one run vs runs resumed from its checkpoints inside an
  epoch: all algorithm state (and the loader's position) is in the checkpoint.

``make_method(**kwargs)`` returns a new :class:`~ssl_lightning.methods.SSLMethod`; it is called
after ``torch.manual_seed`` so both runs start from the same weights. For the 2-process check
it must be a module-level function (it is pickled to the processes by reference).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from ssl_lightning._lightning import ModelCheckpoint, pl
from ssl_lightning.testing.differences import describe, state_differences
from ssl_lightning.testing.process_pool import pool
from ssl_lightning.testing.trainer_runs import (
    ddp_global_order,
    fit_and_dump,
    fit_weights,
)

MethodFactory = Callable[..., pl.LightningModule]


class BatchesDataModule(pl.LightningDataModule):
    """A train loader that yields the given batches, as they are, in order."""

    def __init__(self, batches: Sequence[Any]) -> None:
        super().__init__()
        self.batches = list(batches)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)  # type: ignore[arg-type]


class _RecordLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.losses.append(outputs["loss"].detach().double().clone())


def _datamodule(data: pl.LightningDataModule | Sequence[Any]) -> pl.LightningDataModule:
    return data if isinstance(data, pl.LightningDataModule) else BatchesDataModule(data)


def _fail_if(problems: dict[str, float], what: str, tolerance: float) -> None:
    if problems:
        raise AssertionError(f"{what}:\n{describe(problems, tolerance)}")


def assert_micro_batches_equal_whole_batch(
    make_method: MethodFactory,
    data: pl.LightningDataModule | Sequence[Any],
    micro_batch_size: int = 2,
    steps: int = 3,
    tolerance: float = 1e-10,
    seed: int = 0,
) -> None:
    """``steps`` float64 steps on whole batches and with ``make_method(micro_batch_size=...)``
    give the same weights, buffers and losses (to ``tolerance``, relative).

    Args:
        make_method: Builds the method; called with ``micro_batch_size`` as keyword.
        data: A data module, or a list of batches (each as the train loader would yield it).
        micro_batch_size: Must divide the batch size.
        steps: Optimiser steps of each run.
        tolerance: Largest relative difference allowed (float64 summation order: ~1e-14).
        seed: ``torch.manual_seed`` before each ``make_method``.
    """
    runs = []
    for micro in (None, micro_batch_size):
        torch.manual_seed(seed)
        recorder = _RecordLosses()
        state = fit_and_dump(make_method(micro_batch_size=micro), _datamodule(data),
                             callbacks=[recorder], max_steps=steps, precision="64-true")[0]
        runs.append({"model": state["model"], "loss": recorder.losses})
    whole, micro_run = runs
    _fail_if(state_differences(micro_run, whole, tolerance),
             f"micro_batch_size={micro_batch_size} differs from the whole batch after {steps} "
             "steps (forward_views must not use other samples of the batch, nor draw "
             "randomness that depends on the batch split)", tolerance)


def _fit_all(rank: int, world: int, makers: Sequence[MethodFactory], dataset: Dataset,
             batch_size: int, steps: int, seed: int) -> list[dict[str, Tensor]]:
    """A pool job: every maker's weights after ``steps`` DDP steps on this rank."""
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    return [_fit_one(maker, dataset, batch_size, world, steps, seed) for maker in makers]


def _fit_one(maker: MethodFactory, dataset: Dataset, batch_size: int, devices: int,
             steps: int, seed: int) -> dict[str, Tensor]:
    pl.seed_everything(seed, verbose=False)
    return fit_weights(maker(), dataset, batch_size, devices, steps)


def assert_two_processes_equal_one(
    make_method: MethodFactory | Sequence[MethodFactory],
    dataset: Dataset,
    batch_size: int = 4,
    steps: int = 3,
    tolerance: float = 1e-9,
    seed: int = 0,
) -> None:
    """``steps`` float64 steps on 2 gloo CPU processes (``batch_size`` each) give, on both
    ranks, the weights and buffers of 1 process fed batches of ``2 * batch_size`` in
    ``DistributedSampler``'s order (to ``tolerance``, relative; queues as contents).

    Args:
        make_method: A module-level function building the method (no arguments), or several:
            all train in one job of the 2 processes, and the error names each that differs.
        dataset: Yields ``(views, target[, sample_seed])`` items; at least
            ``2 * batch_size * steps`` of them.
        batch_size: Per-process batch size.
        steps: Optimiser steps.
        tolerance: Largest relative difference allowed.
        seed: ``pl.seed_everything`` before each run (the sampler's shuffling seed too).
    """
    makers = [make_method] if callable(make_method) else list(make_method)
    world = 2
    if len(dataset) < world * batch_size * steps:  # type: ignore[arg-type]
        raise ValueError(f"dataset has {len(dataset)} items; {steps} steps of 2 x {batch_size} "  # type: ignore[arg-type]
                         f"need {world * batch_size * steps}.")
    ranks = pool(world).run(_fit_all, (makers, dataset, batch_size, steps, seed))
    order = ddp_global_order(len(dataset), world, batch_size, seed=seed,  # type: ignore[arg-type]
                             sampler_order=True)
    failures = []
    for i, maker in enumerate(makers):
        single = _fit_one(maker, Subset(dataset, order), world * batch_size, 1, steps, seed)
        for rank, states in enumerate(ranks):
            problems = state_differences(states[i], single, tolerance)
            if problems:
                failures.append(f"{maker.__qualname__}, rank {rank} of 2 processes vs 1 "
                                f"process:\n{describe(problems, tolerance)}")
    if failures:
        raise AssertionError(
            "2 processes differ from 1 process on the global batch (a loss must gather what "
            "it compares across the batch, e.g. self.gather):\n" + "\n".join(failures))


class _StepsPerEpoch(pl.Callback):
    """Records the number of optimizer steps of an epoch (its training batches)."""

    steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps = int(trainer.num_training_batches)


def assert_resume_is_exact(
    make_method: MethodFactory,
    data: pl.LightningDataModule | Sequence[Any],
    checkpoint_dir: str,
    epochs: int = 2,
    stop_steps: Sequence[int] | None = None,
    tolerance: float = 0.0,
    seed: int = 0,
) -> None:
    """A float64 run of ``epochs`` epochs and fresh runs resumed from its checkpoints after
    each of ``stop_steps`` optimizer steps end with the same weights, buffers (queues, centres,
    EMA teachers), optimiser, scheduler and callback states and step (to ``tolerance``,
    relative: 0 means bit-exact, as ``torch.equal``).

    Args:
        make_method: Builds the method (no arguments).
        data: A data module, or a list of batches (one epoch). Each run gets its own copy. A
            stop inside an epoch needs a loader whose position is in the checkpoint: the
            package's data modules, or :class:`~ssl_lightning.testing.ViewsDataModule` for
            ready views (Lightning restarts a plain loader's epoch at its first batch).
        checkpoint_dir: An empty folder for the checkpoints (e.g. pytest's ``tmp_path``).
        epochs: Epochs of every run.
        stop_steps: Optimizer steps done when a run resumes; by default after the first step
            of every epoch (inside it, when an epoch has more than one step).
        tolerance: Largest relative difference allowed.
        seed: ``torch.manual_seed`` before the first ``make_method``.
    """
    torch.manual_seed(seed)
    saver = ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=1, save_top_k=-1,
                            filename="{step}")
    steps = _StepsPerEpoch()
    # float64 from the start: Lightning restores the checkpoint into the module before its
    # precision plugin converts it, so a float32 module would round the restored state
    straight = fit_and_dump(make_method().double(), _datamodule(copy.deepcopy(data)),
                            callbacks=[saver, steps], max_epochs=epochs, precision="64-true",
                            enable_checkpointing=True)[0]
    total = straight["global_step"]
    stops = list(stop_steps) if stop_steps is not None else [
        1 + epoch * steps.steps for epoch in range(epochs) if 1 + epoch * steps.steps < total]
    if not stops or not all(0 < step < total for step in stops):
        raise ValueError(f"stop_steps must be steps in [1, {total}) of the {epochs}-epoch run, "
                         f"got {stops}.")
    keys = ("model", "optimizer", "scheduler", "global_step")
    expected = {k: straight[k] for k in keys}
    expected["callbacks"] = {k: v for k, v in straight["callbacks"].items()
                             if k not in ("ModelCheckpoint", "_StepsPerEpoch")}
    failures = []
    for step in stops:
        checkpoint = Path(checkpoint_dir) / f"step={step}.ckpt"
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
        if not state_differences(straight["model"], saved, 0.0, queues_as_contents=False):
            raise AssertionError(f"the steps after step {step} change no weight or buffer, so "
                                 "a resume from it would pass trivially: train with a "
                                 "learning rate that moves the weights.")
        torch.manual_seed(seed + 1)  # resuming must not depend on the fresh instance's weights
        resumed = fit_and_dump(make_method().double(), _datamodule(copy.deepcopy(data)),
                               max_epochs=epochs, precision="64-true", weights_only=True,
                               ckpt_path=str(checkpoint))[0]
        actual = {k: resumed[k] for k in keys}
        actual["callbacks"] = resumed["callbacks"]
        problems = state_differences(actual, expected, tolerance, queues_as_contents=False)
        if problems:
            failures.append(f"resumed after step {step} of {total} (epoch "
                            f"{(step - 1) // max(steps.steps, 1)}):\n"
                            f"{describe(problems, tolerance)}")
    if failures:
        raise AssertionError(
            f"a resumed run differs from the uninterrupted run after {epochs} epochs "
            "(algorithm state must be a registered buffer or a callback state, randomness must "
            "come from torch's generator, which the method reseeds before every batch, and "
            "the loader's position must be in the checkpoint):\n" + "\n".join(failures))
