"""One pass over this rank's share of the training set, outside the trainer's train loader.

DeepCluster v2 (Caron et al., NeurIPS 2020, Appendix; the official ``main_deepclusterv2.py``,
``init_memory``) fills its memory bank before training with one no-grad forward of the
untrained network over the training data. :func:`epoch0_batches` yields the batches such a pass
needs, as a training step would receive them in epoch 0: a separate loader over the train
loader's dataset, collate function and workers (the trainer's loader and its checkpointed
position stay untouched), this rank's share of the samples in the train sampler's epoch-0 order
(the same DDP split), every sample once (no batch dropped; a rank short of samples repeats its
first ones, as ``DistributedSampler`` pads), and each batch through the precision plug-in's
input conversion and the batch-transfer hooks (so ``DeviceViews`` makes the views there, as in
training). The views are those of epoch 0's sample seeds, so the pass is a pure function of the
data and the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ssl_lightning._lightning import before_batch_transfer, pl
from ssl_lightning.data.seeding import EpochSampler


def _epoch0_sampler(loader: DataLoader, world: int, rank: int) -> Sampler:
    """This rank's keys of epoch 0, mirroring the train sampler (``EpochSampler``'s
    ``(epoch, index)`` keys, a ``DistributedSampler``'s split and order; else every
    ``world``-th index in dataset order), without dropping a last partial batch."""
    sampler = loader.sampler
    dataset = loader.dataset
    if isinstance(sampler, EpochSampler):
        return EpochSampler(dataset, sampler.batch_size, drop_last=False,
                            num_replicas=sampler.num_replicas, rank=sampler.rank,
                            seed=sampler.seed, shuffle=sampler.shuffle)
    if isinstance(sampler, DistributedSampler):
        return DistributedSampler(dataset, num_replicas=sampler.num_replicas, rank=sampler.rank,
                                  shuffle=sampler.shuffle, seed=sampler.seed, drop_last=False)
    return DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)


def epoch0_batches(trainer: pl.Trainer) -> Iterator[Any]:
    """This rank's epoch-0 training batches, on the device, as a training step receives them.

    Args:
        trainer: A trainer inside ``fit`` whose train loader is set up.
    """
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        raise ValueError(f"A pass over the training set needs a DataLoader as the train loader, "
                         f"got {type(loader).__name__}.")
    workers = loader.num_workers
    batches = DataLoader(
        loader.dataset, batch_size=loader.batch_size,
        sampler=_epoch0_sampler(loader, trainer.world_size, trainer.global_rank),
        collate_fn=loader.collate_fn, num_workers=workers, pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        prefetch_factor=loader.prefetch_factor if workers else None,
    )
    module = trainer.lightning_module
    for batch in batches:
        batch = trainer.precision_plugin.convert_input(batch)
        batch = before_batch_transfer(module, batch)  # as the fit loop
        yield trainer.strategy.batch_to_device(batch, dataloader_idx=0)


@contextmanager
def train_mode_unchanged_state(*modules: nn.Module) -> Iterator[None]:
    """Run ``modules`` in train mode (BatchNorm normalises with the batch's statistics, as the
    official code, which never calls ``eval()`` for its pass) and afterwards restore their
    modes and buffers (BatchNorm's running statistics), so the pass changes nothing else."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    buffers = [(b, b.detach().clone()) for module in modules for b in module.buffers()]
    try:
        for module in modules:
            module.train()
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for m, mode in modes:
            m.training = mode
