"""Global-batch mixup (training/mixup.py): the formula on one process, and 2 simulated ranks
(interleaved samples, a rank-major gathered batch) mixing exactly the pairs of one process."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning.training.mixup import global_batch_mixup


def test_one_process_mixes_with_the_seeded_permutation() -> None:
    x = torch.randn(6, 3, 2, 2, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    lam = float(torch.rand((), generator=g, dtype=torch.float64))
    perm = torch.randperm(6, generator=g)
    mixed = global_batch_mixup(x, x, 1, 0, seed=7)
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x[perm], atol=0, rtol=0)


def test_two_ranks_mix_the_pairs_of_one_process() -> None:
    x = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    single = global_batch_mixup(x, x, 1, 0, seed=3)
    gathered = torch.cat([x[0::2], x[1::2]])  # rank-major, rank r holding samples r::2
    for rank in (0, 1):
        mixed = global_batch_mixup(x[rank::2], gathered, 2, rank, seed=3)
        torch.testing.assert_close(mixed, single[rank::2], atol=0, rtol=0)
    with pytest.raises(ValueError, match="not world"):
        global_batch_mixup(x[0::2], x[0::2], 2, 0, seed=3)
