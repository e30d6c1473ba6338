"""Embeddings kept across steps in a first-in-first-out ring buffer: :class:`FeatureQueue`
(MoCo's negatives, NT-Xent's memory bank, SMoG's and ReSSL's queues) and
:class:`NearestNeighbourSupport`, the support set of NNCLR / NNBYOL / NNSiam / All4One,
and :class:`ObjectQueue`, CrIBo's bank of object representations."""

from ssl_lightning.queues.feature_queue import FeatureQueue
from ssl_lightning.queues.object_queue import ObjectQueue
from ssl_lightning.queues.support_set import NearestNeighbourSupport

__all__ = ["FeatureQueue", "NearestNeighbourSupport", "ObjectQueue"]
