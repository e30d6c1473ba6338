"""Spherical k-means (DeepCluster v2 appendix, SwAV paper; SMoG's group reset) against a float64
reference written from the formulas with plain loops: assignment ``argmax_k <x/|x|, c_k/|c_k|>``,
update ``c_k = normalise(sum_{i: a_i = k} x_i / n_k)``, an empty cluster keeping ``c_k``; and
k-means on the row shares of 2 processes (sums and counts summed over ranks) equal to one
process on all rows."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.clustering import (
    assign_to_centroids,
    initial_centroids,
    spherical_kmeans,
    update_centroids,
)


def _normalise(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def _reference_round(rows: list[list[float]], centroids: list[list[float]]
                     ) -> tuple[list[int], list[list[float]]]:
    """One assignment + update round, from the formulas."""
    cs = [_normalise(c) for c in centroids]
    assignment = []
    for row in rows:
        x = _normalise(row)
        sims = [sum(a * b for a, b in zip(x, c, strict=True)) for c in cs]
        assignment.append(max(range(len(cs)), key=lambda k: (sims[k], -k)))
    new = []
    for k, c in enumerate(cs):
        members = [rows[i] for i, a in enumerate(assignment) if a == k]
        if not members:
            new.append(c)
            continue
        mean = [sum(col) / len(members) for col in zip(*members, strict=True)]
        new.append(_normalise(mean))
    return assignment, new


def test_rounds_match_the_float64_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 5, generator=generator, dtype=torch.float64)
    start = initial_centroids(rows, 6, seed=3)
    expected_centroids = start.tolist()
    for _ in range(4):
        expected_assignment, expected_centroids = _reference_round(rows.tolist(),
                                                                   expected_centroids)
    centroids = spherical_kmeans(rows, start, iterations=4)
    assert torch.allclose(centroids, torch.tensor(expected_centroids, dtype=torch.float64),
                          atol=1e-12, rtol=0)
    before_last = spherical_kmeans(rows, start, iterations=3)
    assert assign_to_centroids(rows, before_last).tolist() == expected_assignment


def test_empty_cluster_keeps_its_centroid() -> None:
    rows = torch.tensor([[1.0, 0.0], [0.9, 0.1]], dtype=torch.float64)
    centroids = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    assignment = assign_to_centroids(rows, centroids)
    assert assignment.tolist() == [0, 0]
    new = update_centroids(rows, assignment, centroids)
    assert torch.equal(new[1], centroids[1])
    assert torch.allclose(new[0], torch.nn.functional.normalize(rows.mean(0), dim=0))


def test_initial_centroids_are_seeded_distinct_rows() -> None:
    rows = torch.arange(20.0).view(10, 2)
    first, again = initial_centroids(rows, 4, seed=1), initial_centroids(rows, 4, seed=1)
    assert torch.equal(first, again) and len({tuple(r) for r in first.tolist()}) == 4
    assert not torch.equal(first, initial_centroids(rows, 4, seed=2))
    with pytest.raises(ValueError, match="k=11 for 10 rows"):
        initial_centroids(rows, 11, seed=0)


def _kmeans(rank: int, world: int) -> torch.Tensor:
    """Centroids of spherical k-means on this rank's rows ``rank::world`` of a float64 bank."""
    bank = torch.randn(30, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return spherical_kmeans(bank[rank::world], initial_centroids(bank, 5, seed=1), iterations=4)


@pytest.mark.slow
def test_kmeans_on_row_shares_of_two_processes_equals_one_process() -> None:
    from distributed_utils import run_in_processes

    single = _kmeans(0, 1)
    for centroids in run_in_processes(_kmeans, 2):
        assert float((centroids - single).abs().max()) < 1e-12
