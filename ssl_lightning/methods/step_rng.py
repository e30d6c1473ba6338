"""Model-side randomness as a pure function of (seed, epoch, batch index, rank).

Stochastic depth (ViT / timm ``drop_path_rate``), dropout, masks and any ``torch.rand*`` inside
a method's forward draw from torch's global generators: the CPU one, and the CUDA one for
tensors on a GPU. Lightning does not checkpoint them, so a resumed run would draw other numbers
than the uninterrupted run. :class:`~ssl_lightning.methods.base.SSLMethod` therefore reseeds them
before every training batch from :func:`step_seed`; a batch's draws then depend only on the
run's seed and the batch's position, never on what ran before it (earlier steps, validation,
a restart).

The data pipeline is not affected: it seeds and restores the CPU generator around each sample
(:mod:`ssl_lightning.data.seeding`), and its seeds are derived in another domain, so no model
seed equals a sample or view seed of the same run.
"""

from __future__ import annotations

import os

import torch

from ssl_lightning.data.seeding import mix64

_DOMAIN = 0x6D6F64656C726E67  # "modelrng": separates these seeds from the data pipeline's
_ODD = 0xD6E8FEB86659FD93  # a 64-bit odd multiplier spreading the small integers apart
_SEED_BITS = (1 << 63) - 1  # keep seeds positive for int64


def step_seed(seed: int, epoch: int, batch: int, rank: int) -> int:
    """Seed of training batch ``batch`` of ``epoch`` on ``rank`` in a run seeded ``seed``.

    A chain of splitmix64 finalisers (bijective 64-bit hashes), so any two different argument
    tuples give unrelated seeds.
    """
    z = mix64(seed ^ _DOMAIN)
    for part in (epoch, batch, rank):
        z = mix64(z ^ ((part + 1) * _ODD))
    return z & _SEED_BITS


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
