"""Exact distributed k-means over memory banks (DeepCluster v2, SMoG)."""

from ssl_lightning.clustering.bank import DatasetBank
from ssl_lightning.clustering.groups import momentum_group_update
from ssl_lightning.clustering.kmeans import (
    assign_to_centroids,
    initial_centroids,
    spherical_kmeans,
    update_centroids,
)

__all__ = ["DatasetBank", "assign_to_centroids", "initial_centroids", "spherical_kmeans",
           "update_centroids", "momentum_group_update"]
