"""Augmentation randomness as a pure function of (seed, epoch, sample index, view).

Random augmentations normally draw from the global torch RNG of whichever process runs them, so
the views of a sample depend on the number of loader workers, on which worker got which batch and
on how far each worker's RNG has advanced; a run resumed from a checkpoint draws different views.
Here every sample gets its own seed instead:

- :class:`EpochSampler` yields ``(epoch, index)`` keys, so the epoch travels with each index to
  the worker (also with ``persistent_workers``, where a dataset attribute set in the main
  process never reaches the workers' copies); its order is ``randperm`` seeded by
  ``seed + epoch`` (as ``DistributedSampler``, which it extends) and its position is part of
  ``state_dict`` (torchdata's ``StatefulDataLoader`` saves it, Lightning puts it into the
  checkpoint).
- :class:`SeededDataset` runs the wrapped dataset's ``__getitem__`` with the global (CPU) torch RNG
  seeded by :func:`sample_seed` ``(seed, epoch, index)`` (and restores the RNG afterwards), so
  any torchvision pipeline, including a user's own, is a pure function of the sample key.
- :class:`~ssl_lightning.data.MultiViewTransform` re-seeds per view from :func:`view_seed`
  while a sample seed is active (:func:`active_sample_seed`), so view ``v`` does not depend on
  how many random numbers the views before it drew.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SEED_BITS = (1 << 63) - 1  # torch.manual_seed accepts [0, 2**64); keep it positive for int64
_active_seed: contextvars.ContextVar[int | None] = contextvars.ContextVar("sample_seed",
                                                                          default=None)


def mix64(value: int) -> int:
    """The splitmix64 finaliser (Steele et al., 2014): a bijective 64-bit integer hash."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of sample ``index`` in ``epoch`` of a run seeded ``seed`` (a 63-bit integer)."""
    z = mix64(seed + _GOLDEN)
    z = mix64(z ^ (epoch + 1) * _GOLDEN)
    return mix64(z ^ (index + 1) * _GOLDEN) & _SEED_BITS


def view_seed(seed: int, view: int) -> int:
    """Seed of view ``view`` of the sample seeded ``seed``."""
    return mix64(seed ^ (view + 1) * 0xD1B54A32D192ED03) & _SEED_BITS


def active_sample_seed() -> int | None:
    """The seed of the sample being loaded by :class:`SeededDataset`, None outside of it."""
    return _active_seed.get()


class SeededDataset(Dataset):
    """Items ``(epoch, index) -> (views, target, sample seed)``: ``dataset[index]`` drawn with
    the global RNG seeded per sample, and that seed (a Python int below 2**63: the loader's
    default collate makes the batch's int64 tensor; a tensor per sample would cost 2 % of
    the per-image views' time).

    The seed travels with the sample into the batch ``(views, targets, sample_seeds)``: the
    batched :class:`~ssl_lightning.data.DeviceViews` derives its draws from it, and the
    methods their masks and stochastic depth (:mod:`ssl_lightning.training.sample_rng`).

    Args:
        dataset: Map-style dataset whose ``__getitem__`` applies the random transform and
            returns ``(views, target)``.
        seed: Run seed; the sample seed is ``sample_seed(seed, epoch, index)``.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        if not isinstance(key, tuple):
            raise TypeError(f"SeededDataset is indexed by (epoch, index) keys from EpochSampler, "
                            f"got {key!r}.")
        epoch, index = key
        seed = sample_seed(self.seed, epoch, index)
        generator = torch.default_generator  # the CPU RNG the transforms draw from
        state = generator.get_state()
        token = _active_seed.set(seed)
        try:
            # Not torch.manual_seed: it also queues a CUDA re-seed with a stack trace per call
            # (~0.5 ms, measured), 100x the cost of seeding the CPU generator.
            generator.manual_seed(seed)
            item = self.dataset[index]
        finally:
            _active_seed.reset(token)
            generator.set_state(state)
        views, target = item
        return views, target, seed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dataset}, seed={self.seed})"


class EpochSampler(DistributedSampler):
    """Shuffled ``(epoch, index)`` keys of this rank, resumable mid-epoch.

    The order is ``DistributedSampler``'s (a permutation seeded by ``seed + epoch``, padded to
    a multiple of ``num_replicas``, rank ``r`` taking every ``num_replicas``-th index from
    ``r``), so one process and ``W`` DDP processes see the same global order. Lightning leaves a
    ``DistributedSampler`` in place under DDP and calls :meth:`set_epoch`.

    Args:
        dataset: The dataset (only its length is used).
        batch_size: Per-device batch size (recorded in the state, to check the layout on load).
        drop_last: The loader drops the last incomplete batch (where an epoch ends).
        num_replicas: Number of processes (world size).
        rank: This process' global rank.
        seed: Order seed.
        shuffle: Shuffle (True for training).
    """

    def __init__(self, dataset: Dataset, batch_size: int, drop_last: bool = True,
                 num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=False)
        self.batch_size = batch_size
        self.drop_last_batch = drop_last
        self.dataset_size = len(dataset)  # type: ignore[arg-type]
        self.yielded = 0  # keys of this rank handed out in the current epoch
        self._skip = 0  # keys to skip at the next __iter__ (a restored position)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch, skip = self.epoch, self._skip
        self._skip, self.yielded = 0, skip
        indices = list(super().__iter__())
        for index in indices[skip:]:
            self.yielded += 1
            yield epoch, index

    def _layout(self) -> dict[str, int]:
        return {"num_replicas": self.num_replicas, "batch_size": self.batch_size,
                "dataset_size": self.dataset_size}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "yielded": self.yielded, "seed": self.seed,
                "drop_last": self.drop_last_batch, **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch and position; a finished epoch resumes at the next one.

        Raises:
            ValueError: the checkpoint stopped inside an epoch with another world size,
                per-device batch size or dataset length.
        """
        epoch, yielded = int(state["epoch"]), int(state["yielded"])
        saved = {k: int(state[k]) for k in self._layout()}
        per_rank = math.ceil(saved["dataset_size"] / saved["num_replicas"])
        end = per_rank // saved["batch_size"] * saved["batch_size"] if state["drop_last"] \
            else per_rank
        finished = yielded >= end
        if not finished and yielded > 0 and saved != self._layout():
            raise ValueError(
                f"The checkpoint stopped inside epoch {epoch} with the data layout {saved}, but "
                f"this run has {self._layout()}: the position in the epoch cannot be mapped. "
                "Resume with the checkpoint's world size (devices x nodes), batch_size and "
                "dataset, or from a checkpoint written at the end of an epoch.")
        self.seed = int(state["seed"])
        self.epoch = epoch + 1 if finished else epoch
        self._skip = 0 if finished else yielded
        self.yielded = self._skip


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (two's complement) values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` of every element of an int64 tensor (multiplication wraps modulo 2**64)."""
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def view_seed_tensor(seeds: torch.Tensor, view: int) -> torch.Tensor:
    """:func:`view_seed` of every element of an int64 tensor of sample seeds."""
    return mix64_tensor(seeds ^ _signed((view + 1) * 0xD1B54A32D192ED03 & _MASK64)) & _SEED_BITS


def counter_uniform(keys: torch.Tensor, counter: int, columns: int) -> torch.Tensor:
    """(len(keys), columns) uniforms in [0, 1): draw ``counter`` of the streams ``keys``.

    A counter-based generator (the splitmix64 stream of each key at positions
    ``counter * 64 + column``): no state, any subset of rows or draws can be recomputed.
    """
    if columns > 64:
        raise ValueError(f"counter_uniform draws at most 64 columns per counter, got {columns}.")
    steps = torch.arange(columns, device=keys.device, dtype=torch.int64) + (counter * 64 + 1)
    x = keys.view(-1, 1) + steps * _signed(_GOLDEN)
    return _shr(mix64_tensor(x), 40).float() * (1.0 / (1 << 24))


def _unmix64(value: int) -> int:
    """The inverse of :func:`mix64`."""
    z = value & _MASK64
    z ^= (z >> 31) ^ (z >> 62)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & _MASK64
    z ^= (z >> 27) ^ (z >> 54)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _MASK64
    return z ^ (z >> 30) ^ (z >> 60)


def sample_index(sample: int, seed: int, epoch: int, dataset_size: int) -> int:
    """The dataset index whose :func:`sample_seed` ``(seed, epoch, index)`` is ``sample``.

    :func:`sample_seed` is a bijective hash of the index up to its dropped top bit, so both
    values of that bit are tried and the one giving an index in ``[0, dataset_size)`` whose seed
    is ``sample`` is returned (the methods that need a sample's dataset index, DeepCluster v2,
    derive it from the seed the batch already carries).

    Raises:
        ValueError: no index (or more than one) of the dataset has this seed in this epoch.
    """
    z = mix64(mix64(seed + _GOLDEN) ^ (epoch + 1) * _GOLDEN)
    inverse_golden = pow(_GOLDEN, -1, 1 << 64)
    found = []
    for top in (0, 1 << 63):
        index = ((_unmix64(sample | top) ^ z) * inverse_golden - 1) & _MASK64
        if index < dataset_size and sample_seed(seed, epoch, index) == sample:
            found.append(index)
    if len(found) != 1:
        raise ValueError(
            f"The sample seed {sample} is not the seed of exactly one index of a dataset of "
            f"{dataset_size} samples in epoch {epoch} with seed {seed} (found {found}): the "
            "batches must come from SeededDataset (the package's data modules) with this seed "
            "and epoch.")
    return found[0]


def sample_indices(seeds: torch.Tensor, seed: int, epoch: int,
                   dataset_size: int) -> torch.Tensor:
    """:func:`sample_index` of every element of an int64 tensor of sample seeds."""
    values = [sample_index(int(s), seed, epoch, dataset_size) for s in seeds.tolist()]
    return torch.tensor(values, dtype=torch.long, device=seeds.device)
