"""Per-sample model-side keys (ssl_lightning/training/sample_rng.py): the counter-based
uniforms, stochastic depth keyed by (sample, crop, call) whatever the batch layout, the keys'
split into micro-batches, and the global-generator fallback outside a keyed forward. The
Trainer-level equalities (2 processes = 1 process = micro-batches) are in
tests/distributed/test_sample_rng_ddp.py."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward, keyed_uniform

SEEDS = torch.arange(1, 9, dtype=torch.int64) * 0x2545F4914F6CDD1D


def _keys(seeds: torch.Tensor, rank: int = 0, world: int = 1) -> SampleKeys:
    return SampleKeys.from_seeds(seeds, rng_seed=3, rank=rank, world_size=world, step_seed=11)


def test_keyed_uniforms_are_uniform_in_0_1_and_a_function_of_key_and_column() -> None:
    u = keyed_uniform(torch.arange(4000, dtype=torch.int64), 50)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(keyed_uniform(torch.tensor([17, 3]), 50), u[[17, 3]])


def test_drop_path_decisions_follow_the_sample_crop_and_call() -> None:
    drop = DropPath(0.5).train()
    x = torch.ones(2 * 8, 3)  # two crops of 8 samples, view-major

    def keep(keys: SampleKeys, rows: torch.Tensor, calls: int = 1) -> list[torch.Tensor]:
        with keyed_forward(keys):
            return [drop(rows)[:, 0] > 0 for _ in range(calls)]

    first, second = keep(_keys(SEEDS), x, calls=2)
    assert not torch.equal(first, second)  # each call its own draw
    assert not torch.equal(first[:8], first[8:])  # each crop its own draw
    assert torch.equal(keep(_keys(SEEDS), x)[0], first)  # a new forward redraws the same
    for rank in (0, 1):  # rank r's samples r::2 keep their decisions on 2 processes
        local = keep(_keys(SEEDS[rank::2], rank, 2), torch.ones(2 * 4, 3))[0]
        assert torch.equal(local, first.view(2, 8)[:, rank::2].flatten())
    micro = [keep(k, torch.ones(2 * 4, 3))[0] for k in _keys(SEEDS).split(4)]
    assert torch.equal(torch.stack([m.view(2, 4) for m in micro], 1).flatten(), first)
    assert 4 <= int(first.sum()) <= 12


def test_positions_and_the_step_order_are_those_of_the_global_batch() -> None:
    whole = _keys(SEEDS)
    order = whole.global_order(2, stream=0)
    assert sorted(order.flatten().tolist()) == list(range(16))
    for rank in (0, 1):
        local = _keys(SEEDS[rank::2], rank, 2)
        assert local.positions.tolist() == list(range(rank, 8, 2))
        assert torch.equal(local.global_order(2, stream=0), order[:, rank::2])


def test_outside_a_keyed_forward_drop_path_uses_the_global_generator() -> None:
    drop = DropPath(0.5).train()
    torch.manual_seed(0)
    a = drop(torch.ones(64, 2))
    torch.manual_seed(0)
    assert torch.equal(drop(torch.ones(64, 2)), a)
    with keyed_forward(_keys(SEEDS)), pytest.raises(ValueError, match="view-major"):
        drop(torch.ones(12, 2))  # 12 rows are no whole crops of 8 samples


def test_a_third_batch_element_that_is_not_int64_seeds_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="third element of a training batch"):
        _keys(torch.ones(8))
