"""SimMIM's RandomUnitMasking: square units of patches, the unit count of the paper's code
(ceil(units · ratio)), keyed by sample seed, and its errors."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning.masking import RandomUnitMasking


def test_units_are_whole_squares_with_the_codes_count() -> None:
    masks = RandomUnitMasking(grid=8, unit=2, mask_ratio=0.6)(5, seeds=torch.arange(5))
    assert masks.shape == (5, 64) and masks.dtype == torch.bool
    units = masks.view(5, 4, 2, 4, 2)
    assert (units == units[:, :, :1, :, :1]).all()  # each 2 x 2 unit is all in or all out
    assert (units[:, :, 0, :, 0].sum(dim=(1, 2)) == 10).all()  # ceil(16 · 0.6)
    assert len({tuple(m.tolist()) for m in masks}) == 5


def test_masks_follow_the_sample_seed_not_the_batch() -> None:
    masking = RandomUnitMasking(grid=4, unit=1, mask_ratio=0.5)
    whole = masking(6, seeds=torch.arange(6))
    assert torch.equal(masking(3, seeds=torch.arange(3, 6)), whole[3:])
    torch.manual_seed(0)
    shared = masking(3, world_size=2, rank=1)  # unkeyed: this rank's rows of the global batch
    torch.manual_seed(0)
    assert torch.equal(shared, masking(6)[3:])


@pytest.mark.parametrize("grid, unit, ratio, message", [
    (8, 3, 0.5, "must divide the patch grid"), (8, 0, 0.5, "must divide the patch grid"),
    (8, 2, 1.0, r"in \(0, 1\)")])
def test_bad_settings_are_refused(grid: int, unit: int, ratio: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RandomUnitMasking(grid, unit, ratio)
