"""EpochSampler and the per-sample seeds: order a function of (seed, epoch), the same
global order on 1 and W processes, position state, layout checks; seeds and counter draws."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning.data.seeding import (
    EpochSampler,
    SeededDataset,
    counter_uniform,
    mix64,
    mix64_tensor,
    sample_seed,
    view_seed,
    view_seed_tensor,
)
from ssl_lightning.data.transforms import SimCLRViews

DATA = list(range(10))


def _keys(sampler: EpochSampler) -> list[tuple[int, int]]:
    return list(iter(sampler))


def test_order_is_a_function_of_seed_and_epoch_and_ranks_interleave() -> None:
    one = EpochSampler(DATA, batch_size=2, seed=5)
    one.set_epoch(3)
    again = EpochSampler(DATA, batch_size=2, seed=5)
    again.set_epoch(3)
    assert _keys(one) == _keys(again)
    assert {e for e, _ in _keys(one)} == {3} and sorted(i for _, i in _keys(one)) == DATA
    ranks = [EpochSampler(DATA, 2, num_replicas=2, rank=r, seed=5) for r in (0, 1)]
    for r in ranks:
        r.set_epoch(3)
    interleaved = [k for pair in zip(*map(_keys, ranks), strict=True) for k in pair]
    assert interleaved == _keys(one)  # rank r takes every 2nd index from r
    other = EpochSampler(DATA, batch_size=2, seed=5)
    other.set_epoch(4)
    assert _keys(other) != _keys(one)


def test_state_restores_the_position_and_a_finished_epoch_moves_on() -> None:
    sampler = EpochSampler(DATA, batch_size=2, seed=1)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    restored = EpochSampler(DATA, batch_size=2, seed=0)
    restored.load_state_dict(sampler.state_dict())
    assert head + _keys(restored) == _keys(sampler)
    list(it)  # the epoch ends
    restored.load_state_dict(sampler.state_dict())
    assert restored.epoch == 3 and len(_keys(restored)) == 10


def test_mid_epoch_state_with_another_layout_names_both() -> None:
    sampler = EpochSampler(DATA, batch_size=2, num_replicas=2, seed=1)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    for other in (EpochSampler(DATA, 2, num_replicas=1), EpochSampler(DATA, 1, num_replicas=2),
                  EpochSampler(DATA[:8], 2, num_replicas=2)):
        with pytest.raises(ValueError, match="layout.*num_replicas.*this run has"):
            other.load_state_dict(state)
    list(it)
    fresh = EpochSampler(DATA, 2, num_replicas=1)
    fresh.load_state_dict(sampler.state_dict())  # epoch end: any layout continues
    assert fresh.epoch == 1


def test_seeds_differ_and_tensor_versions_match_the_integer_ones() -> None:
    seeds = {sample_seed(0, e, i) for e in range(3) for i in range(100)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)
    values = [0, 1, 2**63 - 1, *list(seeds)[:20]]
    t = torch.tensor(values, dtype=torch.int64)
    assert mix64_tensor(t).tolist() == [m - 2**64 if m >= 2**63 else m for m in map(mix64, values)]
    assert view_seed_tensor(t, 2).tolist() == [view_seed(v, 2) for v in values]
    u = counter_uniform(torch.arange(20000), 1, 3)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    torch.testing.assert_close(u.mean(0), torch.full((3,), 0.5), atol=0.01, rtol=0)
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.03


def test_seeded_dataset_is_a_pure_function_and_keeps_the_global_rng() -> None:
    class Images:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            return SimCLRViews("cifar", crop_size=8)(torch.full((3, 16, 16), i * 40,
                                                                dtype=torch.uint8)), i

    data = SeededDataset(Images(), seed=7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = data[(1, 2)][0]
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)  # another global RNG state: same views
    assert all(torch.equal(a, b) for a, b in zip(first, data[(1, 2)][0], strict=True))
    assert not torch.equal(first[0], data[(2, 2)][0][0])  # other epoch, other views
    with pytest.raises(TypeError, match="EpochSampler"):
        data[2]  # type: ignore[index]


def test_seeded_device_views_draw_the_generator_path_distribution() -> None:
    """Counter-based per-sample draws give DeviceViews' (torchvision's) parameter laws."""
    from ssl_lightning.data import DeviceViews

    views, n = DeviceViews("cifar", crop_size=16), 4000

    def draws() -> tuple[torch.Tensor, torch.Tensor]:
        boxes = views.crop_boxes(n, 32, 32, "cpu")
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / 1024
        return area, (views._uniform((n,), device="cpu") < views.flip_p).float()

    torch.manual_seed(0)
    area, flip = draws()
    views._keys, views._counter = view_seed_tensor(torch.arange(n), 0), 0
    seeded_area, seeded_flip = draws()
    views._keys = None
    q = torch.linspace(0.05, 0.95, 19)
    torch.testing.assert_close(seeded_area.quantile(q), area.quantile(q), atol=0.03, rtol=0)
    assert abs(float(seeded_flip.mean()) - 0.5) < 0.03 and abs(float(flip.mean()) - 0.5) < 0.03
