"""Masks of MAE and I-JEPA: counts, per-sample randomness, reproducibility, the
global-batch layout under DDP, and I-JEPA's block constraints."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.data import MAEViews
from ssl_lightning.masking import MultiBlockMasking, RandomMasking


def test_mae_masking_keeps_the_count_per_sample_and_differs_across_samples() -> None:
    torch.manual_seed(0)
    keep, masked = RandomMasking(64, 0.75)(256)
    assert keep.shape == (256, 16) and masked.shape == (256, 48)
    both = torch.cat([keep, masked], dim=1).sort(dim=1).values
    assert torch.equal(both, torch.arange(64).expand(256, -1))  # a partition of the grid
    sets = {tuple(row) for row in keep.sort(dim=1).values.tolist()}
    assert len(sets) == 256  # every sample its own mask
    frequency = torch.zeros(64).index_add_(0, masked.flatten(), torch.ones(masked.numel())) / 256
    assert frequency.min() > 0.6 and frequency.max() < 0.9  # uniform: 0.75 +- 5 sigma


def test_mae_masking_is_reproducible_and_rank_slices_the_global_batch() -> None:
    torch.manual_seed(3)
    whole = RandomMasking(64, 0.75)(8)
    torch.manual_seed(3)
    again = RandomMasking(64, 0.75)(8)
    assert all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
    for rank in (0, 1):
        torch.manual_seed(3)
        local = RandomMasking(64, 0.75)(4, world_size=2, rank=rank)
        assert torch.equal(local[0], whole[0][4 * rank:4 * rank + 4])
    torch.manual_seed(4)
    assert not torch.equal(RandomMasking(64, 0.75)(8)[0], whole[0])


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, 1.5, 0.999])
def test_mae_mask_ratio_outside_the_open_interval_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="mask_ratio"):
        RandomMasking(64, ratio)


def _rectangle(indices: list[int], grid: int) -> tuple[int, int]:
    """(height, width) of the indices if they fill a rectangle exactly, else fail."""
    rows, cols = {i // grid for i in indices}, {i % grid for i in indices}
    assert max(rows) - min(rows) + 1 == len(rows) and max(cols) - min(cols) + 1 == len(cols)
    assert len(indices) == len(rows) * len(cols) == len(set(indices))
    return len(rows), len(cols)


@pytest.mark.parametrize("grid", [8, 14])
def test_ijepa_masks_satisfy_the_paper_constraints(grid: int) -> None:
    masking = MultiBlockMasking(grid)  # 4 targets 0.15-0.2, aspect 0.75-1.5, context 0.85-1
    n = grid * grid
    torch.manual_seed(0)
    seen_sizes = set()
    for step in range(12):
        context, targets = masking(16, step)
        (th, tw), (ch, cw) = sizes = masking.block_sizes(step)
        seen_sizes.add(sizes)
        keep = masking.context_count(sizes)
        assert context.shape == (16, keep) and targets.shape == (16, 4, th * tw)
        assert keep >= 10
        # Scales and aspect ratios within the paper's ranges, up to rounding h and w by 1/2.
        lo = (th - 0.5) * (tw - 0.5) / n
        hi = (th + 0.5) * (tw + 0.5) / n
        assert lo <= 0.2 and hi >= 0.15, (th, tw)
        assert (th - 0.5) / (tw + 0.5) <= 1.5 and (th + 0.5) / (tw - 0.5) >= 0.75
        assert (ch + 0.5) * (cw + 0.5) / n >= 0.85 and ch == cw
        for b in range(16):
            blocks = [set(targets[b, m].tolist()) for m in range(4)]
            for block in blocks:
                assert _rectangle(sorted(block), grid) == (th, tw)
            ctx = context[b].tolist()
            assert ctx == sorted(set(ctx))  # distinct, sorted
            assert not set(ctx) & set().union(*blocks)  # context ∩ targets = ∅
            rows, cols = {i // grid for i in ctx}, {i % grid for i in ctx}
            assert max(rows) - min(rows) < ch and max(cols) - min(cols) < cw  # inside its block
        positions = {tuple(targets[b, :, 0].tolist()) for b in range(16)}
        assert len(positions) > 8  # positions drawn per sample
    assert len(seen_sizes) > 3  # sizes vary from step to step


def test_ijepa_block_sizes_are_per_step_and_masks_reproducible_and_rank_sliced() -> None:
    masking = MultiBlockMasking(8)
    assert masking.block_sizes(5) == MultiBlockMasking(8).block_sizes(5)  # all ranks, resumes
    other = MultiBlockMasking(8, seed=1)
    assert [other.block_sizes(s) for s in range(20)] != [masking.block_sizes(s) for s in range(20)]
    torch.manual_seed(7)
    whole = masking(6, step=5)
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(whole, masking(6, step=5), strict=True))
    for rank in (0, 1):
        torch.manual_seed(7)
        context, targets = masking(3, step=5, world_size=2, rank=rank)
        assert torch.equal(context, whole[0][3 * rank:3 * rank + 3])
        assert torch.equal(targets, whole[1][3 * rank:3 * rank + 3])
    # Micro-batches of one step have the same shapes (sizes fixed by the step, not the call).
    assert masking(2, step=5)[1].shape[1:] == masking(4, step=5)[1].shape[1:]


def test_ijepa_blocks_that_cannot_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        MultiBlockMasking(4, target_scale=(0.9, 1.0))
    with pytest.raises(ValueError, match="do not fit"):
        MultiBlockMasking(8, context_scale=(0.1, 0.1), min_context=10)
    with pytest.raises(ValueError, match="no patch"):
        MultiBlockMasking(2, target_scale=(0.1, 0.2), min_context=1)
    with pytest.raises(ValueError, match="target_scale"):
        MultiBlockMasking(8, target_scale=(0.3, 0.2))
    crowded = MultiBlockMasking(8, target_scale=(0.3, 0.3), min_context=40, max_tries=5)
    with pytest.raises(ValueError, match="min_context"):
        crowded(4, step=0)


def test_mae_views_is_one_view_of_the_crop_size() -> None:
    from PIL import Image

    image = Image.new("RGB", (40, 40), (120, 30, 200))
    views = MAEViews(preset="cifar")(image)
    assert len(views) == 1 and views[0].shape == (3, 32, 32)
    assert torch.allclose(views[0][:, 0, 0], views[0][:, -1, -1])  # crop + flip of a flat image
    assert math.isclose(float(views[0][0, 0, 0]), (120 / 255 - 0.4914) / 0.2470, rel_tol=1e-5)
    with pytest.raises(ValueError, match="flip_p"):
        MAEViews(flip_p=2.0)


def _seeds(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64) * 0x5851F42D4C957F2D


def test_seeded_masks_belong_to_the_sample_not_to_the_batch_layout() -> None:
    from ssl_lightning.masking import BlockMasking

    seeds, rows = _seeds(8), torch.tensor([5, 2, 7])
    block = BlockMasking(probability=0.5)
    whole = block(8, (6, 6), seeds)
    assert torch.equal(block(3, (6, 6), seeds[rows]), whole[rows])
    assert 0 < int(whole.any(1).sum()) < 8  # some images masked, some not
    keep, masked = RandomMasking(64, 0.75)(8, seeds=seeds)
    part = RandomMasking(64, 0.75)(3, seeds=seeds[rows])
    assert torch.equal(part[0], keep[rows]) and torch.equal(part[1], masked[rows])
    assert len({tuple(r) for r in keep.sort(1).values.tolist()}) == 8
    ijepa = MultiBlockMasking(8, min_context=4)
    context, targets = ijepa(8, step=3, seeds=seeds)
    sub_context, sub_targets = ijepa(3, step=3, seeds=seeds[rows])
    assert torch.equal(sub_context, context[rows]) and torch.equal(sub_targets, targets[rows])
    for c, t in zip(context.tolist(), targets.tolist(), strict=True):
        assert not set(c) & {i for block_ in t for i in block_}  # context avoids the targets
        assert len(set(c)) == len(c) == ijepa.context_count(ijepa.block_sizes(3))


def test_stratified_block_masks_mask_int_n_p_images_with_ratios_from_their_slices() -> None:
    from ssl_lightning.masking import BlockMasking

    n, grid = 12, (10, 10)
    block = BlockMasking(ratio=(0.1, 0.5), probability=0.5, patience=50)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    masks = block(n, grid, _seeds(n), order, n)
    counts = masks.sum(1)
    masked = int(n * 0.5)
    assert torch.equal(counts > 0, order < masked)  # exactly the first int(n p) places
    width = 0.4 / masked
    for place, count in zip(order.tolist(), counts.tolist(), strict=True):
        if place < masked:  # the place's slice of the ratio range (+- BEiT's fill shortfall)
            low, high = 0.1 + place * width, 0.1 + (place + 1) * width
            assert round(low * 100) - 3 <= count <= round(high * 100)
