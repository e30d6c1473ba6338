"""The nearest-neighbour support set (NNCLR, NNSiam, NNBYOL, All4One): top-k neighbours in
order of similarity, the nearest first, and its bad settings."""

from __future__ import annotations

import pytest
import torch


def test_support_set_top_k_is_ordered_and_checked() -> None:
    from ssl_lightning.queues import NearestNeighbourSupport

    support = NearestNeighbourSupport(6, 3)
    support.add(torch.eye(3).repeat(2, 1) * torch.tensor([[1.0], [1.0], [1.0], [2.0], [3.0],
                                                          [4.0]]))
    query = torch.tensor([[1.0, 0.2, 0.1]])
    top = support.top_k(query, 3)
    scores = torch.nn.functional.normalize(top[0], dim=1) @ torch.nn.functional.normalize(
        query[0], dim=0)
    assert torch.all(scores[:-1] >= scores[1:]) and torch.equal(top[:, 0],
                                                                 support.nearest(query))
    with pytest.raises(ValueError, match="k must be in"):
        support.top_k(query, 7)
    with pytest.raises(ValueError, match="queue_size"):
        NearestNeighbourSupport(0, 3)
