"""VICRegL: the located views (a view's crop box says where its pixels come from), positions of
the feature map's locations, the method's outputs and loss, micro-batches with boxes, bad input.
The loss itself: tests/losses/test_vicregl_loss.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from micro_batch_utils import whole_and_micro_batch_gradients
from PIL import Image
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data.located_views import LocatedViews, map_positions
from ssl_lightning.data.seeding import SeededDataset
from ssl_lightning.losses import VICRegLLoss
from ssl_lightning.methods import VICRegL

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(expander_hidden_dim=16, expander_dim=16, local_hidden_dim=8, local_dim=8,
             head_batch_norm=False, num_matches=(3, 2), image_size=8)


def _ramp_image() -> Image.Image:
    """32 px: red = 7·row, green = 7·column."""
    rows, cols = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    return Image.fromarray(np.stack([7 * rows, 7 * cols, 0 * rows], -1).astype(np.uint8))


@pytest.mark.parametrize("seed", range(6))
def test_located_views_boxes_give_each_pixels_position_in_the_image(seed: int) -> None:
    # 32 px crops: the cifar preset's square resize to the crop size leaves the image as it is
    transform = LocatedViews(preset="cifar", crop_size=32, crop_scale=(0.2, 0.6), jitter_p=0.0,
                             grayscale_p=0.0, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    torch.manual_seed(seed)
    view1, view2, box1, box2 = transform(_ramp_image())
    for view, box in ((view1, box1), (view2, box2)):
        where = map_positions(box[None], 32, 32)[0].reshape(32, 32, 2)
        seen = view[:2].permute(1, 2, 0) * 255 / 7 + 0.5  # the pixel centres the view shows
        assert float((seen - where).abs().max()) < 0.75, box
    assert box1.tolist() != box2.tolist()


def test_located_views_are_keyed_by_the_sample_seed() -> None:
    transform = LocatedViews(preset="cifar")
    data = SeededDataset(_Images(transform), seed=5)  # type: ignore[arg-type]
    first, again, other = data[0, 1], data[0, 1], data[1, 1]
    assert all(torch.equal(a, b) for a, b in zip(first[0], again[0], strict=True))
    assert not torch.equal(first[0][2], other[0][2])  # another epoch: another box


class _Images:
    def __init__(self, transform: LocatedViews) -> None:
        self.transform = transform

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[list[Tensor], int]:
        return self.transform(_ramp_image()), 0


def test_map_positions_mirror_a_flipped_view() -> None:
    box = torch.tensor([[2.0, 4.0, 8.0, 16.0, 0.0], [2.0, 4.0, 8.0, 16.0, 1.0]])
    plain, flipped = map_positions(box, 2, 2)
    assert plain.tolist() == [[4.0, 8.0], [4.0, 16.0], [8.0, 8.0], [8.0, 16.0]]
    assert flipped.tolist() == [[4.0, 16.0], [4.0, 8.0], [8.0, 16.0], [8.0, 8.0]]


def _batch(seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    views = [torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    boxes = [torch.tensor([[top, left, 20.0, 20.0, f] for top, left, f in
                           ((0, 0, 0), (4, 2, 1), (8, 8, 0), (2, 6, 1))], dtype=torch.float64)
             + k for k in range(2)]
    return views + boxes


def test_vicregl_loss_pairs_the_locations_by_their_boxes() -> None:
    torch.manual_seed(0)
    model = VICRegL(SmallConvNet((8, 16), norm="group"), **SMALL).double()
    batch = _batch()
    outputs = model.forward_views(batch)
    positions = [map_positions(batch[2 + v], 2, 2) for v in (0, 1)]  # the 2 x 2 map of 8 px
    assert torch.equal(outputs["positions2"], positions[1])
    criterion = VICRegLLoss(num_matches=(3, 2))
    expected = criterion([outputs["z1"], outputs["z2"]], [outputs["local1"], outputs["local2"]],
                         positions)
    assert float(model.loss_from_outputs(outputs)) == pytest.approx(float(expected), rel=1e-12)
    moved = [b.clone() for b in batch]
    moved[3][:, 4] = 1 - moved[3][:, 4]  # the second views' flips undone: other positives
    assert float(model.training_loss(moved)[0]) != pytest.approx(float(expected), rel=1e-6)


def test_vicregl_micro_batches_with_boxes_give_the_whole_batch_gradient() -> None:
    batch = _batch(1)

    def make(micro: int | None) -> VICRegL:
        torch.manual_seed(0)
        return VICRegL(SmallConvNet((8, 16), norm="group"), micro_batch_size=micro,
                       **SMALL).double()

    whole, micro = whole_and_micro_batch_gradients(make, batch)
    torch.testing.assert_close(whole, micro, rtol=0, atol=1e-12)


def test_vicregl_position_matching_needs_the_boxes() -> None:
    model = VICRegL(SmallConvNet((8, 16), norm="group"), **SMALL).double()
    views = _batch()[:2]
    with pytest.raises(ValueError, match="VICRegL needs 4 views per sample, got 2"):
        model.training_loss(views)
    with pytest.raises(ValueError, match="needs the crop boxes after the two views"):
        model.training_loss(views + views)
    feature_only = VICRegL(SmallConvNet((8, 16), norm="group"), position_matching=False,
                           **SMALL).double()
    assert torch.isfinite(feature_only.training_loss(views)[0])
