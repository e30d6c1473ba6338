"""Collect the features that ``validation_step`` returns, across batches and ranks.

Every ssl_lightning module's ``validation_step`` returns ``{"features", "targets"}``; callbacks
that need the embeddings of a validation epoch (collapse monitor, embedding pictures) derive
from :class:`ValFeatureCollector` instead of running a second forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ssl_lightning._lightning import pl
from ssl_lightning.callbacks.knn import gather_variable, padding_mask, val_sampler
from ssl_lightning.distributed import world_size


class ValFeatureCollector(pl.Callback):
    """Keeps the validation features of one dataloader for the current epoch.

    Args:
        dataloader_idx: Which val dataloader to use; ``-1``: the last one (the val split when a
            data module returns ``[train_eval, val]``).
        max_samples: Use at most this many samples in total (split evenly over ranks): each rank
            keeps its features of the epoch (in CPU memory) and then a fixed random subset of
            them, so that a class-sorted val loader still gives every class.
    """

    def __init__(self, dataloader_idx: int = -1, max_samples: int = 10_000) -> None:
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}.")
        self.dataloader_idx = dataloader_idx
        self.max_samples = max_samples
        self._features: list[Tensor] = []
        self._targets: list[Tensor] = []
        self._device = torch.device("cpu")
        self._sampler: object = None

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._features, self._targets = [], []

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if dataloader_idx != self.dataloader_idx % len(trainer.num_val_batches):
            return
        if not isinstance(outputs, Mapping) or "features" not in outputs:
            raise ValueError(
                f"{type(self).__name__} needs validation_step to return a dict with 'features' "
                f"and 'targets'; {type(pl_module).__name__} returned {type(outputs).__name__}."
            )
        features = outputs["features"].detach()
        self._device = features.device
        self._sampler = val_sampler(trainer, dataloader_idx)
        self._features.append(features.float().flatten(1).cpu())  # off the accelerator
        self._targets.append(outputs["targets"].detach().cpu())

    def collected(self) -> tuple[Tensor, Tensor] | None:
        """``(features, targets)`` of this epoch from all ranks; ``None`` when nothing was seen.

        The duplicates that ``DistributedSampler`` pads the last batch with are dropped, so the
        samples are those of one process (in another order). A collective under DDP: every rank
        must call it.
        """
        if not self._features:
            return None
        features, targets = torch.cat(self._features), torch.cat(self._targets)
        keep = padding_mask(len(targets), self._sampler, targets.device)
        features, targets = features[keep], targets[keep]
        room = math.ceil(self.max_samples / world_size())
        if len(features) > room:  # a fixed random subset: val loaders are often sorted by class
            generator = torch.Generator().manual_seed(0)
            keep = torch.randperm(len(features), generator=generator)[:room].sort().values
            features, targets = features[keep], targets[keep]
        return gather_variable(features.to(self._device)), gather_variable(targets.to(self._device))
