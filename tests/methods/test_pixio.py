"""Pixio: grid masks of whole cells (equal to lightly's ``random_grid_token_mask``), what the
encoder sees, the loss against a float64 loop of the paper's masked-patch MSE, the class-token
features, MAE as the ``mask_grid=1`` special case, and bad input."""

from __future__ import annotations

import pytest
import torch
from lightly.models.utils import random_grid_token_mask
from mim_utils import GRID, PATCH, SIZE, tiny_vit

from ssl_lightning.masking import RandomUnitMasking
from ssl_lightning.methods import MAE, Pixio


def tiny_pixio(**kwargs) -> Pixio:  # type: ignore[no-untyped-def]
    args = dict(mask_grid=2, decoder_dim=16, decoder_depth=2, decoder_heads=2, image_size=SIZE,
                lr=1e-3, lr_scaling="none", warmup_epochs=0)
    return Pixio(tiny_vit(num_registers=2, pool="prefix"), **{**args, **kwargs})


def _cell(patch: int, unit: int) -> tuple[int, int]:
    row, col = divmod(patch, GRID)
    return row // unit, col // unit


def test_grid_masks_are_whole_cells_and_equal_lightlys() -> None:
    masking = RandomUnitMasking(GRID, 2, 0.75)
    torch.manual_seed(3)
    keep, masked = masking.indices(5)
    torch.manual_seed(3)
    lightly_keep, lightly_masked = random_grid_token_mask((5, 1 + GRID * GRID), 0.75, 2, 1)
    assert keep.shape == (5, 4 * 4) and masked.shape == (5, 12 * 4)
    torch.testing.assert_close(keep, (lightly_keep[:, 1:] - 1).sort(dim=1).values)
    torch.testing.assert_close(masked, (lightly_masked - 1).sort(dim=1).values)
    for b in range(5):
        kept_cells = {_cell(p, 2) for p in keep[b].tolist()}
        masked_cells = {_cell(p, 2) for p in masked[b].tolist()}
        assert len(kept_cells) == 4 and len(masked_cells) == 12 and not kept_cells & masked_cells
    # The boolean masks of __call__ are the same draw.
    torch.manual_seed(3)
    as_bool = masking(5)
    assert torch.equal(as_bool.gather(1, masked), torch.ones_like(masked, dtype=torch.bool))
    assert not as_bool.gather(1, keep).any()


def test_keyed_masks_depend_on_the_sample_only() -> None:
    masking = RandomUnitMasking(GRID, 4, 0.75)
    seeds = torch.tensor([11, 12, 13], dtype=torch.int64)
    keep, masked = masking.indices(3, seeds=seeds)
    keep_one, masked_one = masking.indices(1, seeds=seeds[1:2])
    assert torch.equal(keep[1:2], keep_one) and torch.equal(masked[1:2], masked_one)


def test_encoder_sees_class_tokens_and_kept_cells_and_loss_is_the_masked_patch_mse() -> None:
    torch.manual_seed(0)
    model = tiny_pixio().double()
    x = torch.randn(3, 3, SIZE, SIZE, dtype=torch.float64)
    counts: list[int] = []
    model.backbone.blocks[0].register_forward_pre_hook(
        lambda m, args: counts.append(args[0].shape[1]))
    torch.manual_seed(5)
    out = model.forward_views([x])
    loss = model.loss_from_outputs(out)
    assert counts == [3 + GRID * GRID // 4, 3 + GRID * GRID]  # 3 class tokens + 25 % of cells
    torch.manual_seed(5)
    masks = model.masking(3)  # the RNG replay: (B, grid²) bool, True = masked
    pred = out["predictions"].detach()
    total, count = 0.0, 0
    for b in range(3):
        masked = masks[b].nonzero().flatten().tolist()
        for i, j in enumerate(masked):
            r, c = divmod(j, GRID)
            target = x[b, :, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
            target = target.permute(1, 2, 0).flatten()  # (row, col, channel)
            target = (target - target.mean()) / (target.var() + 1e-6).sqrt()
            total += float(((pred[b, i] - target) ** 2).sum())
            count += target.numel()
    assert abs(loss.item() - total / count) < 1e-12
    tokens = model.backbone.forward_tokens(x)
    torch.testing.assert_close(out["features"], tokens[:, :3].mean(dim=1), rtol=0, atol=1e-12)


def test_mask_grid_one_is_mae() -> None:
    """One-patch cells are MAE's masks; the same weights then give MAE's loss."""
    torch.manual_seed(0)
    pixio = tiny_pixio(mask_grid=1).double()
    mae = MAE(tiny_vit(num_registers=2, pool="prefix"), decoder_dim=16, decoder_depth=2,
              decoder_heads=2, image_size=SIZE).double()
    mae.load_state_dict(pixio.state_dict())
    x = torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64)
    torch.manual_seed(7)
    keep, masked = pixio.draw_masks(2)
    torch.manual_seed(7)
    mae_keep, mae_masked = mae.draw_masks(2)
    assert torch.equal(keep, mae_keep.sort(dim=1).values)
    assert torch.equal(masked, mae_masked.sort(dim=1).values)
    torch.manual_seed(7)
    pixio_loss = pixio.loss_from_outputs(pixio.forward_views([x]))
    torch.manual_seed(7)
    mae_loss = mae.loss_from_outputs(mae.forward_views([x]))
    torch.testing.assert_close(pixio_loss, mae_loss, rtol=1e-12, atol=0)


def test_bad_input_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match=r"mask_grid \(3\) must be >= 1 and divide the patch "
                                         r"grid \(8 patches"):
        tiny_pixio(mask_grid=3)
    with pytest.raises(ValueError, match="mask_ratio"):
        tiny_pixio(mask_grid=4, mask_ratio=0.9)  # 4 cells: none kept
    with pytest.raises(ValueError, match="pool must be 'cls', 'mean' or 'prefix'"):
        tiny_vit(pool="max")
