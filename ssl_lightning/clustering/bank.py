"""DatasetBank: the latest embedding of every sample of the dataset, for k-means at each epoch
start (DeepCluster v2, Caron et al. 2020, Appendix; the official code's ``local_memory``).

The bank is stored *globally*: every rank writes the embeddings and dataset indices gathered
from all ranks, so every rank holds the same bank and the checkpoint written by rank 0 resumes
every rank exactly. k-means splits the rows over the ranks (rank ``r`` takes rows ``r::W``)
and sums its statistics across them (:func:`~ssl_lightning.clustering.spherical_kmeans`).
Before a sample is written its row is a seeded random unit vector (the same on every rank);
DeepCluster v2 overwrites every row before its first k-means with a pass of the untrained
network over the data (``init_bank="forward"``, the official code's ``init_memory``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.clustering.kmeans import (
    assign_to_centroids,
    initial_centroids,
    spherical_kmeans,
)
from ssl_lightning.data.seeding import sample_seed
from ssl_lightning.distributed import all_reduce_sum_no_grad, rank, world_size


class DatasetBank(nn.Module):
    """``(crops, dataset_size, dim)`` embeddings, written at dataset indices.

    Args:
        crops: Banks kept (one per assigned crop; DeepCluster v2: 2).
        dim: Embedding size.
        dataset_size: Samples; 0 until :meth:`resize_` is called with the train set's length.
        seed: Seed of the initial rows.
    """

    embeddings: Tensor

    def __init__(self, crops: int, dim: int, dataset_size: int = 0, seed: int = 0) -> None:
        super().__init__()
        if crops < 1 or dim < 1:
            raise ValueError(f"DatasetBank needs crops >= 1 and dim >= 1, got {crops}, {dim}.")
        self.seed = seed
        self.register_buffer("embeddings", torch.empty(crops, 0, dim))
        self.resize_(dataset_size)

    @property
    def dataset_size(self) -> int:
        return self.embeddings.shape[1]

    def resize_(self, dataset_size: int) -> None:
        """(Re)initialise the rows for a dataset of ``dataset_size`` samples (seeded)."""
        crops, _, dim = self.embeddings.shape
        generator = torch.Generator().manual_seed(self.seed)
        rows = F.normalize(torch.randn(crops, dataset_size, dim, generator=generator), dim=2)
        self.embeddings = rows.to(self.embeddings)

    @torch.no_grad()
    def write(self, indices: Tensor, embeddings: Tensor) -> None:
        """Store ``embeddings`` (crops, N, dim) of the samples ``indices`` (N,)."""
        if embeddings.shape[0] != self.embeddings.shape[0] or embeddings.shape[2:] != \
                self.embeddings.shape[2:]:
            raise ValueError(f"Embeddings of shape {tuple(embeddings.shape)} do not fit a bank "
                             f"of {tuple(self.embeddings.shape)}.")
        if indices.numel() and int(indices.max()) >= self.dataset_size:
            raise ValueError(f"Dataset index {int(indices.max())} is outside the bank of "
                             f"{self.dataset_size} samples: the train set changed size.")
        self.embeddings[:, indices] = embeddings.detach().to(self.embeddings.dtype)

    def reduce(self, x: Tensor) -> Tensor:
        """Sum of the k-means statistics over ranks (outside autograd)."""
        return all_reduce_sum_no_grad(x)

    @torch.no_grad()
    def cluster(self, num_clusters: list[int], iterations: int, seed: int
                ) -> tuple[list[Tensor], Tensor]:
        """k-means of bank ``h % crops`` with ``num_clusters[h]`` clusters for every head ``h``.

        Returns:
            The centroids (K_h, dim) of every head and the assignments (H, dataset_size).
        """
        centroids, assignments = [], []
        for head, k in enumerate(num_clusters):
            bank = self.embeddings[head % self.embeddings.shape[0]]
            start = initial_centroids(bank, k, sample_seed(seed, head, 0))
            share = bank[rank()::world_size()]
            centroids.append(spherical_kmeans(share, start, iterations, self.reduce))
            assignments.append(assign_to_centroids(bank, centroids[-1]))
        return centroids, torch.stack(assignments)
