"""Model-side randomness as a pure function of (seed, epoch, batch index, rank).

Masks and stochastic depth are drawn per sample when the batch carries the samples' seeds
(:mod:`ssl_lightning.training.sample_rng`). Dropout, any other ``torch.rand*`` inside a method's
forward, and masks and stochastic depth of batches without seeds draw from torch's global
generators: the CPU one, and the CUDA one for tensors on a GPU. Lightning does not checkpoint
them, so a resumed run would draw other numbers than the uninterrupted run.
:class:`~ssl_lightning.methods.SSLMethod` therefore reseeds them before every training batch
from :func:`step_seed`; a batch's draws then depend only on the run's seed and the batch's
position, never on what ran before it (earlier steps, validation, a restart). The hooks live in
:class:`SeededSteps`, the base of ``SSLMethod`` and ``LinearEval``, with
:meth:`SeededSteps.sample_keys` (the per-sample keys of a batch).

The data pipeline is not affected: it seeds and restores the CPU generator around each sample
(:mod:`ssl_lightning.data.seeding`), and its seeds are derived in another domain, so no model
seed equals a sample or view seed of the same run.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from torch import Tensor

from ssl_lightning._lightning import attached_trainer, pl
from ssl_lightning.data.seeding import mix64
from ssl_lightning.training.sample_rng import SampleKeys

_DOMAIN = 0x6D6F64656C726E67  # "modelrng": separates these seeds from the data pipeline's
_ODD = 0xD6E8FEB86659FD93  # a 64-bit odd multiplier spreading the small integers apart
_SEED_BITS = (1 << 63) - 1  # keep seeds positive for int64
_SHARED = 0x7368617265647374  # "sharedst": separates shared_step_seed from step_seed
RNG_SEED_KEY = "rng_seed"  # checkpoint key of SeededSteps.rng_seed


def step_seed(seed: int, epoch: int, batch: int, rank: int) -> int:
    """Seed of training batch ``batch`` of ``epoch`` on ``rank`` in a run seeded ``seed``.

    A chain of splitmix64 finalisers (bijective 64-bit hashes), so any two different argument
    tuples give unrelated seeds.
    """
    z = mix64(seed ^ _DOMAIN)
    for part in (epoch, batch, rank):
        z = mix64(z ^ ((part + 1) * _ODD))
    return z & _SEED_BITS


def shared_step_seed(seed: int, epoch: int, batch: int, stream: int) -> int:
    """Seed of a decision shared by the whole training batch (the same on every rank): SIGReg's
    projection directions, W-MSE's sub-batches. ``stream`` separates the decisions of one batch;
    no shared seed equals a per-rank :func:`step_seed`."""
    return mix64(step_seed(seed, epoch, batch, 0) ^ mix64(_SHARED ^ stream)) & _SEED_BITS


def default_seed() -> int:
    """The run's seed: ``seed_everything``'s (``PL_GLOBAL_SEED``), else torch's initial seed
    (the value of the last ``torch.manual_seed``, or torch's fixed default)."""
    env = os.environ.get("PL_GLOBAL_SEED")
    return int(env) if env is not None else torch.initial_seed()


def reseed_global_rng(cpu_seed: int, device_seed: int, device: torch.device) -> None:
    """Seed torch's CPU generator with ``cpu_seed`` and ``device``'s generator (CUDA, MPS) with
    ``device_seed``.

    ``Generator.manual_seed`` directly: ``torch.manual_seed`` would also queue a re-seed of every
    CUDA device with a stack trace (~0.5 ms a call, see :mod:`ssl_lightning.data.seeding`).
    """
    torch.default_generator.manual_seed(cpu_seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(device_seed)
    elif device.type == "mps":
        torch.mps.manual_seed(device_seed)


class SeededSteps(pl.LightningModule):
    """A LightningModule whose training batches reseed torch's global generators.

    Before every training batch, the CPU and accelerator generators are seeded from
    :func:`step_seed` ``(rng_seed, epoch, batch index, rank)``. :attr:`rng_seed` is the
    ``rng_seed`` hyperparameter, else :func:`default_seed`; it is fixed at its first use, saved in
    the checkpoint and restored from it. A subclass overriding :meth:`on_train_batch_start`,
    :meth:`on_save_checkpoint` or :meth:`on_load_checkpoint` must call ``super()``.
    """

    #: Seed the CPU generator without the rank, so every rank draws the same CPU stream (MAE,
    #: I-JEPA on batches without sample seeds: each rank takes its rows of the masks drawn for
    #: the global batch). The accelerator's generator is still seeded per rank.
    rng_shared_across_ranks: ClassVar[bool] = False
    _rng_seed: int | None = None
    _batch_idx: int = 0  # of the current training batch (0 outside a Lightning fit)

    @property
    def rng_seed(self) -> int:
        """Seed of the model-side randomness (the ``rng_seed`` argument, else the run's seed)."""
        if self._rng_seed is None:
            given = self.hparams.get("rng_seed")
            self._rng_seed = int(given) if given is not None else default_seed()
        return self._rng_seed

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Reseed torch's global generators: this batch's model-side randomness is a pure
        function of (:attr:`rng_seed`, epoch, batch index, rank)."""
        self.reseed_rng(batch_idx)

    def reseed_rng(self, batch_idx: int) -> None:
        """Seed the CPU and accelerator generators for training batch ``batch_idx`` of the
        current epoch (the CPU one without the rank when :attr:`rng_shared_across_ranks`)."""
        self._batch_idx = batch_idx
        seed, epoch, rank = self.rng_seed, self.current_epoch, self.global_rank
        device_seed = step_seed(seed, epoch, batch_idx, rank)
        cpu_seed = step_seed(seed, epoch, batch_idx, 0) if self.rng_shared_across_ranks \
            else device_seed
        reseed_global_rng(cpu_seed, device_seed, self.device)

    def sample_keys(self, sample_seeds: Tensor, batch_idx: int) -> SampleKeys:
        """The model-side keys (:mod:`~ssl_lightning.training.sample_rng`) of this rank's
        samples in training batch ``batch_idx``, from their data seeds."""
        world = self.trainer.world_size if attached_trainer(self) is not None else 1
        return SampleKeys.from_seeds(sample_seeds, self.rng_seed, self.global_rank, world,
                                     step_seed(self.rng_seed, self.current_epoch, batch_idx, 0))

    def step_generator(self, stream: int) -> torch.Generator:
        """A CPU generator for a decision the whole training batch shares, identical on every
        rank: seeded by :func:`shared_step_seed` (:attr:`rng_seed`, epoch, batch index,
        ``stream``), so 1 and N processes, micro-batching and a resumed run draw the same."""
        seed = shared_step_seed(self.rng_seed, self.current_epoch, self._batch_idx, stream)
        return torch.Generator().manual_seed(seed)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[RNG_SEED_KEY] = self.rng_seed

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Continue with the checkpoint's :attr:`rng_seed` (absent before it was saved)."""
        if RNG_SEED_KEY in checkpoint:
            self._rng_seed = int(checkpoint[RNG_SEED_KEY])
