"""DetCon-S: the segments follow each view's crop box, dataset segment maps, the fallback grid of
plain two-view batches, micro-batches with boxes, bad input. The loss:
tests/losses/test_detcon_loss.py."""

from __future__ import annotations

import pytest
import torch
from micro_batch_utils import whole_and_micro_batch_gradients
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import DetConLoss
from ssl_lightning.masking.segments import location_segments, sampled_segments
from ssl_lightning.methods import DetConS
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import (
    KeyedViews,
    assert_micro_batches_equal_whole_batch,
    assert_two_processes_equal_one,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(projection_hidden_dim=16, projection_dim=8, head_batch_norm=False, grid=2,
             image_size=8)


def _model(**kwargs: object) -> DetConS:
    torch.manual_seed(0)
    return DetConS(SmallConvNet((8, 16), norm="group"), **{**SMALL, **kwargs}).double()


def _views(seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)]


def _boxes() -> list[Tensor]:
    """Crop boxes in a 32 px image: view 1 the left half, view 2 the top-left quarter, mirrored
    for the second and fourth images."""
    first = torch.tensor([[0.0, 0.0, 32.0, 16.0, f] for f in (0, 1, 0, 1)], dtype=torch.float64)
    second = torch.tensor([[0.0, 0.0, 16.0, 16.0, f] for f in (0, 0, 1, 1)], dtype=torch.float64)
    return [first, second]


def test_detcon_s_segments_follow_the_crop_boxes() -> None:
    model = _model(segment_image_size=32)
    outputs = model.forward_views(_views() + _boxes())
    # 2 x 2 grid over the image: the left half holds cells 0 and 2, the top-left quarter cell 0
    assert outputs["ids1"].tolist() == [[0, -1, 2, -1]] * 4
    assert outputs["ids2"].tolist() == [[0, -1, -1, -1]] * 4
    # the second view's only segment is the mean of its 2 x 2 map, whatever its flip
    feature_map = model.backbone.forward_dense(_views()[1])[0]
    torch.testing.assert_close(model.projector(feature_map.mean(dim=(2, 3))),
                               outputs["z2"][:, 0], rtol=1e-12, atol=1e-12)
    expected = DetConLoss(0.1)(outputs["z1"], outputs["z2"], outputs["z1"], outputs["z2"],
                               outputs["ids1"], outputs["ids2"], outputs["ids1"], outputs["ids2"])
    assert float(model.loss_from_outputs(outputs)) == pytest.approx(float(expected), rel=1e-12)


def test_detcon_s_grid_cells_follow_the_views_crop_and_flip() -> None:
    model = _model(segment_image_size=32)
    views = _views()
    whole = torch.tensor([[0.0, 0.0, 32.0, 32.0, f] for f in (0, 1, 0, 1)], dtype=torch.float64)
    outputs = model.forward_views(views + [whole, _boxes()[1]])
    feature_map = model.backbone.forward_dense(views[0])[0]  # 2 x 2 map: one location per cell
    for cell, (row, col) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        plain = model.projector(feature_map[0::2, :, row, col])
        mirrored = model.projector(feature_map[1::2, :, row, 1 - col])  # flipped views
        torch.testing.assert_close(outputs["z1"][0::2, cell], plain, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(outputs["z1"][1::2, cell], mirrored, rtol=1e-12, atol=1e-12)


def test_detcon_s_reads_segment_maps_a_dataset_provides() -> None:
    model = _model(num_segments=3)
    views = _views()
    segments = torch.zeros(4, 8, 8, dtype=torch.long)
    segments[:, :, 4:] = 1  # the right half is segment 1; segment 2 appears in no view
    outputs = model.forward_views(views + [segments, segments.flip(2)])
    assert outputs["ids1"].tolist() == [[0, 1, -1]] * 4
    feature_map = model.backbone.forward_dense(views[1])[0]  # mirrored map: segment 1 on the left
    torch.testing.assert_close(outputs["z2"][:, 1], model.projector(
        feature_map[:, :, :, 0].mean(dim=2)), rtol=1e-12, atol=1e-12)


def test_detcon_s_plain_views_use_a_grid_over_each_view() -> None:
    model = _model()
    views = _views()
    outputs = model.forward_views(views)
    assert outputs["ids1"].tolist() == outputs["ids2"].tolist() == [[0, 1, 2, 3]] * 4
    feature_map = model.backbone.forward_dense(views[0])[0]
    torch.testing.assert_close(outputs["z1"], model.projector(
        feature_map.flatten(2).transpose(1, 2)), rtol=1e-12, atol=1e-12)


def test_detcon_s_micro_batches_with_boxes_give_the_whole_batch_gradient() -> None:
    batch = _views(1) + _boxes()
    whole, micro = whole_and_micro_batch_gradients(
        lambda micro: _model(segment_image_size=32, micro_batch_size=micro), batch)
    torch.testing.assert_close(whole, micro, rtol=0, atol=1e-12)


def test_detcon_s_bad_input() -> None:
    model = _model()
    views = _views()
    with pytest.raises(ValueError, match="DetConS needs 2 views per sample, got 1"):
        model.training_loss(views[:1])
    with pytest.raises(ValueError, match="either their crop boxes"):
        model.training_loss(views + views)
    with pytest.raises(ValueError, match="got 3 entries per sample"):
        model.training_loss(views + _boxes()[:1])
    with pytest.raises(ValueError, match="grid, segment_image_size and num_segments"):
        _model(grid=0)


def _felzenszwalb_maps(seed: int = 0) -> list[Tensor]:
    """Segment maps (4, 8, 8) of two views with ids 0..5: on the 2 x 2 feature map each 4 x 4
    block's majority id is its location's segment."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 6, (4, 8, 8), generator=g) for _ in range(2)]


def test_location_segments_take_the_majority_and_sampling_ranks_the_present_segments() -> None:
    segments = torch.zeros(1, 4, 4, dtype=torch.long)
    segments[0, :2, :2] = torch.tensor([[5, 5], [5, 2]])  # majority 5
    segments[0, :2, 2:] = torch.tensor([[2, 7], [7, 2]])  # tie 2 / 7: the lowest id
    segments[0, 2:, :] = 7
    locations = location_segments(segments, 2, 2)
    assert locations.tolist() == [[5, 2, 7, 7]]
    # present: 2, 5, 7; uniforms pick ranks floor(3u)
    weights, ids = sampled_segments(locations, torch.tensor([[0.0, 0.5, 0.99, 0.34]]))
    assert ids.tolist() == [[2, 5, 7, 5]]
    assert weights[0].T.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0]]


def test_detcon_s_pools_sampled_felzenszwalb_masks_present_in_each_view() -> None:
    model = _model(sampled_masks=5)
    views, maps = _views(), _felzenszwalb_maps()
    outputs = model.forward_views(views + maps)
    for v in range(2):
        ids = outputs[f"ids{v + 1}"]
        locations = location_segments(maps[v], 2, 2)
        feature_map = model.backbone.forward_dense(views[v])[0].flatten(2).transpose(1, 2)
        assert ids.shape == (4, 5)
        for b in range(4):
            for m, segment in enumerate(ids[b].tolist()):
                inside = locations[b] == segment
                assert inside.any()  # only segments present in the view are sampled
                torch.testing.assert_close(outputs[f"z{v + 1}"][b, m], model.projector(
                    feature_map[b, inside].mean(dim=0, keepdim=True))[0], rtol=1e-12,
                    atol=1e-12)


def test_detcon_s_sampled_masks_are_keyed_by_the_sample() -> None:
    """Micro-batches draw the same masks as the whole batch (keyed by each sample's seed);
    known-bad: masks drawn from the global generator give different weights."""
    g = torch.Generator().manual_seed(3)
    batches = [(_views(s) + _felzenszwalb_maps(s), torch.zeros(4, dtype=torch.long),
                torch.randint(0, 2**62, (4,), generator=g)) for s in range(2)]

    def make(**kwargs: object) -> DetConS:
        return _model(sampled_masks=3, lr=0.1, lr_scaling="none", **kwargs)

    assert_micro_batches_equal_whole_batch(make, batches, micro_batch_size=2, steps=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ssl_lightning.methods.detcon_s.active_keys", lambda: None)
        with pytest.raises(AssertionError, match="differs from the whole batch"):
            assert_micro_batches_equal_whole_batch(make, batches, micro_batch_size=2, steps=2)


def test_detcon_s_sampled_masks_need_segment_maps() -> None:
    model = _model(sampled_masks=4, segment_image_size=32)
    with pytest.raises(ValueError, match="use train_transform FelzenszwalbViews"):
        model.training_loss(_views() + _boxes())
    with pytest.raises(ValueError, match="sampled_masks >= 0"):
        _model(sampled_masks=-1)


def test_detcon_s_refuses_sampled_masks_without_felzenszwalb_views_before_training(monkeypatch):
    from types import SimpleNamespace

    from ssl_lightning.data import FelzenszwalbViews, LocatedViews
    from ssl_lightning.methods import detcon_s

    model = _model(sampled_masks=16)
    for transform, refused in ((LocatedViews(), True), (FelzenszwalbViews(), False)):
        monkeypatch.setattr(detcon_s, "attached_trainer", lambda module, t=transform:
                            SimpleNamespace(datamodule=SimpleNamespace(train_transform=t)))
        if refused:
            with pytest.raises(ValueError, match="is LocatedViews: use train_transform "
                                                 "FelzenszwalbViews"):
                detcon_s.check_mask_transform(model, model.sampled_masks)
        else:
            detcon_s.check_mask_transform(model, model.sampled_masks)


class _ViewsWithMaps(KeyedViews):
    """KeyedViews' two 8 px views followed by two segment maps with ids 0..5 per sample."""

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        views, target, seed = super().__getitem__(index)
        g = torch.Generator().manual_seed(index)
        return views + [torch.randint(0, 6, (8, 8), generator=g) for _ in range(2)], target, seed


def _detcon_s_sampled() -> DetConS:
    return method_entry("detcon_s").small(sampled_masks=3, optimizer="sgd", lr=0.5,
                                          lr_scaling="none", warmup_epochs=0)


@pytest.mark.slow
def test_detcon_s_sampled_masks_on_two_processes_equal_one_process() -> None:
    assert_two_processes_equal_one(_detcon_s_sampled, _ViewsWithMaps(24, (8, 8)))
