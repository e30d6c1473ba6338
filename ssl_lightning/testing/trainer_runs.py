"""Building blocks of the end-to-end (Lightning Trainer) DDP-equivalence and resume checks.

- :class:`PrecomputedViews`: a dataset of fixed, precomputed views (deterministic, so two runs
  see exactly the same pixels), with integer targets.
- :class:`KeyedViews`: :class:`PrecomputedViews` whose items also carry the sample's seed of
  epoch 0, as ``SeededDataset``'s do (so masks and drop path are keyed by sample).
- :func:`fit_weights`: the weights after a few float64 optimiser steps of ``Trainer.fit`` in an
  already spawned process group (DDP) or one process.
- :class:`TensorDataModule`: train loader in dataset order (no shuffling), optional val loaders.
- :class:`ViewsDataModule`: the package's resumable training loader over such a dataset
  (shuffled by the epoch, its position in the checkpoint: exact mid-epoch resume).
- :func:`ddp_global_order`: the sample order a single process must use to see, at every step,
  the concatenation of the per-rank batches of a Lightning DDP run (Lightning's training
  ``DistributedSampler`` always shuffles, seeded by ``PL_GLOBAL_SEED``; rank r takes every W-th
  index of the permutation, starting at r).
- :func:`fit_and_dump`: run ``Trainer.fit`` (``devices=2``: DDP on the session's process pool,
  ``process_pool.py``) and return, for every rank, the final model state_dict, optimizer and
  scheduler state and callback states.
- :func:`assert_states_close`: compare two nested states (tensors, dicts, lists, numbers).

Typical use::

    data = PrecomputedViews(16)
    ddp = fit_and_dump(make_model(), TensorDataModule(data, 4), devices=2, max_steps=2)
    single = fit_and_dump(make_model(), TensorDataModule(Subset(data, ddp_global_order(16, 2, 4)),
                          8), devices=1, max_steps=2)
    assert_states_close(ddp[0]["model"], single[0]["model"], atol=1e-6)
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ssl_lightning._lightning import pl
from ssl_lightning.data.base import SSLDataModule
from ssl_lightning.data.seeding import sample_seed
from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform

if TYPE_CHECKING:
    from ssl_lightning.methods.registry import MethodEntry


class PrecomputedViews(Dataset):
    """``num_samples`` items ``([view_0, ..., view_{V-1}], target)`` drawn once from a seed.

    Args:
        num_samples: Dataset size.
        view_sizes: Side of each view (multi-crop: several sizes); 2 views of 8 px by default.
        num_classes: Targets are drawn uniformly from ``[0, num_classes)``.
        seed: Seed of the generator.
    """

    def __init__(
        self,
        num_samples: int,
        view_sizes: Sequence[int] = (8, 8),
        num_classes: int = 4,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.views = [torch.randn(num_samples, 3, s, s, generator=generator) for s in view_sizes]
        self.targets = torch.randint(num_classes, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[list[Tensor], Tensor]:
        return [v[index] for v in self.views], self.targets[index]


class KeyedViews(PrecomputedViews):
    """:class:`PrecomputedViews` (in ``dtype``) whose items ``(views, target, sample_seed)``
    carry each sample's seed of epoch 0, as ``SeededDataset``'s do."""

    def __init__(self, num_samples: int, view_sizes: Sequence[int] = (8, 8),
                 num_classes: int = 4, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(num_samples, view_sizes, num_classes, seed)
        self.views = [v.to(dtype) for v in self.views]
        self.seed = 0  # the run seed of the sample seeds, as SeededDataset.seed

    def __getitem__(self, index: int) -> tuple[list[Tensor], Tensor, Tensor]:
        views, target = super().__getitem__(index)
        return views, target, torch.tensor(sample_seed(self.seed, 0, index), dtype=torch.int64)


def fit_weights(model: pl.LightningModule, data: Dataset, batch: int, devices: int,
                steps: int) -> dict[str, Tensor]:
    """Weights after ``steps`` float64 optimiser steps, on ``devices`` processes (DDP in the
    process group already spawned, e.g. by ``run_in_processes``) or on one."""
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
            max_steps=steps, precision="64-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            default_root_dir=root)
        trainer.fit(model, datamodule=TensorDataModule(data, batch))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class TensorDataModule(pl.LightningDataModule):
    """Train loader over ``train`` in order (``drop_last``), plus optional val loaders.

    Args:
        train: Training dataset yielding ``(views, target)``.
        batch_size: Per-device batch size.
        val: Validation datasets (e.g. ``[bank, queries]`` for the kNN callback).
        val_batch_size: Batch size of the val loaders (``batch_size`` when None).
    """

    def __init__(
        self,
        train: Dataset,
        batch_size: int,
        val: Sequence[Dataset] = (),
        val_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.train, self.batch_size, self.val = train, batch_size, list(val)
        self.val_batch_size = val_batch_size or batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=False, drop_last=True)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(v, batch_size=self.val_batch_size, shuffle=False) for v in self.val]


def entry_data(entry: MethodEntry, num_samples: int, batch_size: int) -> TensorDataModule:
    """``num_samples`` fixed random views of the sizes ``entry``'s method trains on, with each
    sample's seed (:class:`KeyedViews`) when the method needs them, in batches of
    ``batch_size``."""
    views = (KeyedViews if entry.needs_sample_seeds else PrecomputedViews)(num_samples,
                                                                           entry.views)
    return TensorDataModule(views, batch_size)


class ViewsDataModule(SSLDataModule):
    """Training on a dataset of ready ``(views, target)`` items (e.g. :class:`PrecomputedViews`)
    through the package's own training loader: batches ``(views, targets, sample_seeds)`` in
    :class:`~ssl_lightning.data.seeding.EpochSampler`'s order (shuffled by ``seed`` and the
    epoch), whose position and seed go into the checkpoint, so a run resumed inside an epoch
    continues with the batch the uninterrupted run took next. No evaluation data; the loader
    runs in this process.

    Args:
        dataset: Yields ``(views, target)``; its views are the batches' views as they are.
        batch_size: Per-device batch size (the last incomplete batch is dropped).
        seed: Seed of the order (and of the sample seeds).
        train_transform: The kind of views the dataset holds, for the methods that check it
            (ReSSL reads its ``weak_views``); not applied. ``SimCLRViews`` when None.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int = 0,
                 train_transform: MultiViewTransform | None = None) -> None:
        super().__init__(batch_size=batch_size, num_workers=0, pin_memory=False,
                         persistent_workers=False, seed=seed, train_transform=train_transform)
        self.dataset = dataset

    def build_train(self, transform: MultiViewTransform) -> Dataset:
        """The dataset as given (its views are made already; ``transform`` is not used)."""
        return self.dataset

    def build_eval(self, transform: EvalTransform) -> None:
        """No evaluation data."""
        return None


def ddp_global_order(
    num_samples: int, world_size: int, batch_size: int, epochs: int = 1, seed: int = 0,
    sampler_order: bool = False,
) -> list[int]:
    """Indices such that single-process batch s (of ``world_size * batch_size``) is the
    rank-ordered concatenation of the rank batches s of a Lightning DDP run, or, with
    ``sampler_order``, the same samples in the sampler's own order (rank r holds positions r,
    r + W, ... of it: what a 1-GPU run with that sampler order sees).

    Lightning replaces the train sampler by ``DistributedSampler(shuffle=True,
    seed=PL_GLOBAL_SEED)`` (even when the loader does not shuffle): each epoch e draws
    ``randperm(num_samples)`` from seed + e and rank r takes every W-th index from r. ``seed``
    must be the value given to ``pl.seed_everything`` (0 when it was never called). Batches are
    dropped at the end as with ``drop_last=True``; pass ``epochs`` for a multi-epoch run.
    """
    order: list[int] = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(world_size):
            sampler = DistributedSampler(
                range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=seed
            )
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        steps = len(per_rank[0]) // batch_size
        if sampler_order:
            order += [rank_indices[k] for k in range(steps * batch_size)
                      for rank_indices in per_rank]
            continue
        order += [
            i
            for s in range(steps)
            for rank_indices in per_rank
            for i in rank_indices[s * batch_size : (s + 1) * batch_size]
        ]
    return order


def queue_contents(queue: Tensor) -> Tensor:
    """A queue's slots (dim -2) in a canonical order (by the first feature of the first leading
    index, the same permutation for all: SwAV's per-view queues stay aligned), so equal contents
    compare equal whatever slots the enqueue order gave them."""
    if queue.dim() < 2:
        return queue
    slots = queue.double().reshape(-1, *queue.shape[-2:])
    return slots[:, torch.argsort(slots[0, :, 0])]


class _DumpState(pl.Callback):
    """Keeps this rank's final states (``state``); 1 torch thread per process under DDP."""

    state: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            torch.set_num_threads(1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = trainer_state(trainer, pl_module)


def trainer_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """Copies of the states a run holds now: ``model`` (state_dict), ``optimizer`` and
    ``scheduler`` (lists of state_dicts), ``callbacks`` (class name -> ``state_dict()``, this
    module's dump callback left out), ``global_step`` and ``metrics``."""
    return {
        "model": _clone(pl_module.state_dict()),
        "optimizer": _clone([o.state_dict() for o in trainer.optimizers]),
        "scheduler": _clone([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]),
        "callbacks": _clone(
            {type(c).__name__: c.state_dict() for c in trainer.callbacks
             if not isinstance(c, _DumpState)}
        ),
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def _clone(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def fit_and_dump(
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    devices: int = 1,
    callbacks: Sequence[pl.Callback] = (),
    ckpt_path: str | None = None,
    weights_only: bool | None = None,
    **trainer_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit on CPU and return each rank's final states.

    ``devices > 1`` runs DDP in the gloo group of the session's process pool
    (:func:`~ssl_lightning.testing.process_pool.pool`): each rank receives a copy of ``model``,
    ``datamodule`` and ``callbacks`` and the caller's random states, as ``ddp_spawn`` would give
    it, without starting processes; a rank that raises fails the call with its traceback. The
    pool's processes are daemons: their loaders run without worker processes (``num_workers=0``).

    Each entry has ``model`` (state_dict), ``optimizer`` and ``scheduler`` (lists of
    state_dicts), ``callbacks`` (class name -> ``state_dict()``), ``global_step`` and
    ``metrics`` (``trainer.callback_metrics`` as floats). ``trainer_kwargs`` go to the Trainer
    (``max_steps``, ``max_epochs``, ``default_root_dir``, ...); logging, checkpointing,
    progress bars and sanity validation are off unless given; ``weights_only`` goes to
    ``Trainer.fit`` (how ``ckpt_path`` is read).
    """
    if devices > 1:
        from ssl_lightning.testing.process_pool import pool

        return pool(devices).run(_fit_and_dump_rank, (
            model, datamodule, list(callbacks), ckpt_path, weights_only, trainer_kwargs,
            _random_states()))
    return [_fit(model, datamodule, 1, callbacks, ckpt_path, weights_only, trainer_kwargs)]


def _random_states() -> tuple[Any, Any, Any]:
    """The caller's torch, NumPy and Python random states (what a spawned rank starts with)."""
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def _fit_and_dump_rank(rank: int, world: int, model: pl.LightningModule,
                       datamodule: pl.LightningDataModule, callbacks: list[pl.Callback],
                       ckpt_path: str | None, weights_only: bool | None,
                       trainer_kwargs: dict[str, Any], states: tuple[Any, Any, Any]
                       ) -> dict[str, Any]:
    """A pool job: this rank's part of :func:`fit_and_dump` (DDP in the pool's group)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      NODE_RANK="0")
    torch.random.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])
    try:
        return _fit(model, datamodule, world, callbacks, ckpt_path, weights_only, trainer_kwargs)
    except Exception as err:  # Lightning's teardown may raise another error on top of it
        if not any("daemonic processes" in str(e) for e in _exception_chain(err)):
            raise
        raise ValueError("fit_and_dump(devices > 1) runs its ranks in the process pool, whose "
                         "processes cannot start DataLoader workers: give the data module "
                         "num_workers=0") from None


def _exception_chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _fit(model: pl.LightningModule, datamodule: pl.LightningDataModule, devices: int,
         callbacks: Sequence[pl.Callback], ckpt_path: str | None, weights_only: bool | None,
         trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    """This process's fit (DDP in the existing process group when ``devices > 1``) and its
    final states."""
    dump = _DumpState()
    with tempfile.TemporaryDirectory() as root_dir:
        settings: dict[str, Any] = dict(
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root_dir,
        )
        settings.update(trainer_kwargs)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy="ddp" if devices > 1 else "auto",
            callbacks=[*callbacks, dump],
            **settings,
        )
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only)
    if dump.state is None:
        raise RuntimeError("the fit ended before on_train_end: no final states to return")
    return dump.state


def max_relative_difference(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Largest ``‖a − e‖ / ‖e‖`` over the floating-point tensors of two state dicts (the others
    must be equal)."""
    assert set(actual) == set(expected)
    worst = 0.0
    for key, e in expected.items():
        if e.is_floating_point() and e.numel():
            norm = float(torch.linalg.vector_norm(e.double())) or 1.0
            worst = max(worst, float(torch.linalg.vector_norm((actual[key] - e).double())) / norm)
        else:
            assert torch.equal(actual[key], e), key
    return worst


def assert_states_close(actual: Any, expected: Any, atol: float = 1e-6, path: str = "") -> None:
    """Recursively assert that two nested states are equal (tensors to ``atol``, rtol 0)."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{path}: not a tensor"
        assert actual.shape == expected.shape, f"{path}: {actual.shape} != {expected.shape}"
        if expected.is_floating_point():
            torch.testing.assert_close(actual, expected, atol=atol, rtol=0, msg=path)
        else:
            assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {set(actual) ^ set(expected)}"
        for key in expected:
            assert_states_close(actual[key], expected[key], atol, f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_states_close(a, e, atol, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
