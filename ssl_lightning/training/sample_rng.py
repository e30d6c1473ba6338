"""Model-side randomness keyed by sample: masks and stochastic depth as pure functions of each
sample's seed, never of the rank, the process count or the micro-batch.

The augmentations already draw from the sample's seed (:func:`~ssl_lightning.data.seeding.
sample_seed` of run seed, epoch and dataset index); :class:`~ssl_lightning.data.seeding.
SeededDataset` also hands that seed to the method as the third element of the batch
``(views, targets, sample_seeds)``. :class:`~ssl_lightning.methods.SSLMethod` turns it into
:class:`SampleKeys` (mixed with its ``rng_seed`` into a domain of its own) and runs the networks
inside :func:`keyed_forward`; there

- :class:`~ssl_lightning.backbones.vit.DropPath` (also inside a
  :class:`~ssl_lightning.backbones.TimmBackbone`) draws each row's keep decision from
  :func:`row_uniforms`: the key of the row's sample, its crop (the view-major position of the row
  among the crops of one call) and the call's number in the forward (block, branch, resolution
  group — the same sequence for every batch layout);
- the mask generators take per-image seeds (:meth:`SampleKeys.streams`) or uniforms
  (:func:`keyed_uniform`), and DINOv2's stratified mask ratios take each image's place in a
  random order of the global batch drawn from the step seed (:meth:`SampleKeys.global_order`).

A sample's random decisions are then the same on 1 process, on N processes, in any micro-batch
and in a resumed run. Outside :func:`keyed_forward` (a user's data module whose batches are
``(views, targets)``, a user's own loop) everything falls back to torch's global generator,
which :class:`~ssl_lightning.training.step_rng.SeededSteps` reseeds per (seed, epoch, batch,
rank).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ssl_lightning.data.seeding import _signed, mix64, mix64_tensor

_DOMAIN = 0x73616D706C65726E  # "samplern": separates the model keys from the data seeds
_ODD = 0xD6E8FEB86659FD93
_MASK64 = (1 << 64) - 1
_SEED_BITS = (1 << 63) - 1


def derive(keys: Tensor, part: int) -> Tensor:
    """Keys of sub-stream ``part`` of each of ``keys`` (int64): a splitmix64 of key and part."""
    return mix64_tensor(keys ^ _signed((part + 1) * _ODD & _MASK64))


def keyed_uniform(keys: Tensor, columns: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """(len(keys), columns) uniforms in [0, 1) with 53 random bits: column ``c`` of row ``i`` is
    a hash of ``(keys[i], c)`` (counter-based: any row or column can be recomputed alone).

    Unlike the augmentations' :func:`~ssl_lightning.data.seeding.counter_uniform` (24-bit
    float32, at most 64 columns per counter, kept as it is so that views stay unchanged): any
    number of columns (MAE's noise over every patch) and no ties in an argsort."""
    steps = torch.arange(1, columns + 1, device=keys.device, dtype=torch.int64)
    bits = mix64_tensor(keys.view(-1, 1) + steps * _signed(0x9E3779B97F4A7C15))
    return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64).mul_(2.0 ** -53).to(dtype)


@dataclass
class SampleKeys:
    """Per-sample random keys of a batch (or micro-batch) and where its samples sit in the step.

    Attributes:
        keys: (B,) int64 model-side keys of the samples (:meth:`from_seeds`).
        positions: (B,) int64 position of each sample in the step's global batch, in the
            samplers' order: local sample ``j`` of rank ``r`` of ``W`` is ``j · W + r`` (the order
            one process holding the global batch sees).
        global_batch: Samples of the step on all ranks.
        step_seed: Seed shared by every rank and micro-batch of the step.
    """

    keys: Tensor
    positions: Tensor
    global_batch: int
    step_seed: int
    calls: int = field(default=0, compare=False)  # keyed draws made so far in this forward

    @classmethod
    def from_seeds(cls, sample_seeds: Tensor, rng_seed: int, rank: int, world_size: int,
                   step_seed: int) -> SampleKeys:
        """Keys of a rank's batch from its samples' data seeds (``SeededDataset``) and the
        method's ``rng_seed``."""
        if sample_seeds.dim() != 1 or sample_seeds.dtype != torch.int64:
            raise ValueError(
                f"The third element of a training batch must be the samples' seeds, a (B,) int64 "
                f"tensor; got {sample_seeds.dtype} of shape {tuple(sample_seeds.shape)}. Return "
                "(views, target) items, or (views, target, int64 seed) as SeededDataset does.")
        base = _signed(mix64(rng_seed ^ _DOMAIN))
        batch = sample_seeds.shape[0]
        positions = torch.arange(batch, device=sample_seeds.device) * world_size + rank
        return cls(mix64_tensor(sample_seeds ^ base), positions, batch * world_size, step_seed)

    def split(self, size: int) -> list[SampleKeys]:
        """Micro-batches of ``size`` samples (the last may be smaller), each with its own keys."""
        return [SampleKeys(k, p, self.global_batch, self.step_seed)
                for k, p in zip(self.keys.split(size), self.positions.split(size), strict=True)]

    def streams(self, part: int) -> Tensor:
        """(B,) keys of the samples' sub-stream ``part`` (e.g. the masks of crop ``part``)."""
        return derive(self.keys, part)

    def global_order(self, crops: int, stream: int) -> Tensor:
        """(crops, B) place of each (crop, sample) image in a random order of the step's
        ``crops × global_batch`` images, drawn from the step seed: the same on every rank."""
        generator = torch.Generator().manual_seed(
            mix64(self.step_seed ^ (stream + 1) * _ODD) & _SEED_BITS)
        order = torch.randperm(crops * self.global_batch, generator=generator)
        image = torch.arange(crops).view(-1, 1) * self.global_batch + self.positions.cpu()
        return order[image]


_active: contextvars.ContextVar[SampleKeys | None] = contextvars.ContextVar("sample_keys",
                                                                            default=None)


@contextmanager
def keyed_forward(keys: SampleKeys | None) -> Iterator[SampleKeys | None]:
    """Run a forward with ``keys`` active (None: the global-generator fallback); the count of
    keyed draws (:func:`row_uniforms`) starts at 0, so every forward of the same samples through
    the same code makes the same draws."""
    if keys is not None:
        keys = SampleKeys(keys.keys, keys.positions, keys.global_batch, keys.step_seed)
    token = _active.set(keys)
    try:
        yield keys
    finally:
        _active.reset(token)


def active_keys() -> SampleKeys | None:
    """The keys of the forward running now, None outside :func:`keyed_forward`."""
    return _active.get()


def row_uniforms(rows: int, device: torch.device) -> Tensor | None:
    """One uniform per row of a (rows, ...) tensor in the active forward, None outside one.

    Rows are view-major concatenations of the batch's crops (``torch.cat(crops)``): row ``i`` is
    sample ``i mod B`` in crop ``i // B``. Each call takes the next draw number, so the draws of
    a forward are keyed by (sample, crop, call).

    Raises:
        ValueError: ``rows`` is not a multiple of the batch (a layout that is not view-major).
    """
    keys = _active.get()
    if keys is None:
        return None
    batch = keys.keys.shape[0]
    if batch == 0 or rows % batch:
        raise ValueError(f"A keyed draw over {rows} rows in a forward of {batch} samples: rows "
                         "must be view-major concatenations of the batch's crops (torch.cat).")
    crops = torch.arange(1, rows // batch + 1, device=device).repeat_interleave(batch)
    call_keys = derive(keys.keys.to(device), 1_000_000 + keys.calls).repeat(rows // batch)
    keys.calls += 1
    row_keys = mix64_tensor(call_keys ^ crops * _signed(0xD1B54A32D192ED03))
    return keyed_uniform(row_keys, 1)[:, 0]


def step_uniforms(count: int) -> Tensor | None:
    """``count`` float64 uniforms in [0, 1) that belong to the whole step, not to a sample (e.g.
    RoPE's coordinate augmentation): drawn from the step seed and the active forward's draw
    number, so every rank and every micro-batch of the step draws the same values; None outside
    a keyed forward."""
    keys = _active.get()
    if keys is None:
        return None
    key = torch.tensor([_signed(mix64(keys.step_seed ^ (2_000_000 + keys.calls) * _ODD))])
    keys.calls += 1
    return keyed_uniform(key, count)[0]
