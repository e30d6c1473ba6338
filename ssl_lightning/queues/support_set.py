"""The nearest-neighbour support set of NNCLR, NNBYOL, NNSiam and All4One.

Dwibedi et al., "With a Little Help from My Friends: Nearest-Neighbor Contrastive Learning of
Visual Representations", ICCV 2021, §3.1: a FIFO queue of normalised projections of earlier
batches; each projection of the current batch is replaced by its nearest stored neighbour (All4One,
Estepa et al. 2023, also uses the top-k). The methods fill it with the projections of the
*gathered* batch, so it is the same on every rank and on one process holding the global batch;
it is a :class:`~ssl_lightning.queues.FeatureQueue` (buffers ``queue``, ``queue_ptr``), so it
resumes with the checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning.queues.feature_queue import FeatureQueue


class NearestNeighbourSupport(FeatureQueue):
    """A support set of ``size`` normalised projections of dimension ``dim``.

    Args:
        size: Stored projections (the method's ``queue_size``); a multiple of the global batch.
        dim: Projection size.
    """

    def __init__(self, size: int, dim: int) -> None:
        if size < 1:
            raise ValueError(f"queue_size (the support set) must be >= 1, got {size}.")
        super().__init__(size, dim)

    def neighbours(self, *queries: Tensor) -> list[Tensor]:
        """The nearest stored projection of every row of each query (no gradient)."""
        return [self.nearest(query.detach()) for query in queries]

    @torch.no_grad()
    def add(self, projections_all: Tensor) -> None:
        """Enqueue the normalised projections of the gathered (global) batch."""
        self.enqueue(F.normalize(projections_all.detach(), dim=1))
