"""NeCo: the shared-region alignment of two views, the method's handling of crop boxes, and its
reference patches. The loss is tests/losses/test_neco_loss.py's; the registry's property tests
(tests/properties) run the method."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from ssl_lightning.data.located_views import LocatedViews
from ssl_lightning.losses.region_align import align_region, shared_region
from ssl_lightning.methods.neco import NeCo
from ssl_lightning.methods.registry import method_entry, small_convnet


def _box(top: float, left: float, height: float, width: float, flipped: bool) -> torch.Tensor:
    return torch.tensor([[top, left, height, width, float(flipped)]], dtype=torch.float64)


def test_a_mirrored_view_gives_the_same_grid() -> None:
    feature_map = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    box_a, box_b = _box(0, 0, 32, 32, False), _box(8, 12, 40, 40, False)
    region, overlaps = shared_region(box_a, box_b)
    assert overlaps.tolist() == [True]
    plain = align_region(feature_map, box_b, region, 3)
    mirrored = align_region(feature_map.flip(-1), _box(8, 12, 40, 40, True), region, 3)
    assert torch.allclose(plain, mirrored, atol=1e-12)


def test_both_views_sample_the_same_image_locations() -> None:
    """An image-level field seen whole (view a) and through a crop (view b, same scale): the
    aligned grids of the crop's region agree (grid cells on pixel centres, so exact)."""
    field = torch.randn(1, 4, 16, 16, dtype=torch.float64)
    box_a, box_b = _box(0, 0, 16, 16, False), _box(4, 4, 8, 8, False)
    region, _ = shared_region(box_a, box_b)
    in_a = align_region(field, box_a, region, 4)
    in_b = align_region(field[..., 4:12, 4:12], box_b, region, 4)
    assert torch.allclose(in_a, in_b, atol=1e-12)
    wrong = align_region(field, box_a, shared_region(box_a, _box(4, 5, 8, 8, False))[0], 4)
    assert not torch.allclose(wrong, in_b, atol=1e-6)


def test_disjoint_crops_have_no_shared_region() -> None:
    _, overlaps = shared_region(_box(0, 0, 8, 8, False), _box(8, 0, 8, 8, False))
    assert overlaps.tolist() == [False]


def _small() -> NeCo:
    torch.manual_seed(0)
    return method_entry("neco").small(small_convnet()).double()


def test_samples_without_a_shared_region_are_left_out() -> None:
    method = _small()
    views = [torch.randn(3, 3, 8, 8, dtype=torch.float64) for _ in range(2)]
    apart = [torch.tensor([[0, 0, 8, 8, 0]] * 3, dtype=torch.float64),
             torch.tensor([[20, 20, 8, 8, 0]] * 3, dtype=torch.float64)]
    loss = method.loss_from_outputs(method.forward_views(views + apart))
    assert loss.item() == 0.0 and loss.requires_grad
    together = [apart[0], apart[0].clone()]
    assert method.loss_from_outputs(method.forward_views(views + together)).item() > 0


def test_references_are_the_teacher_patches_shuffled() -> None:
    method = _small()
    teacher = torch.randn(3, 4, 8, dtype=torch.float64)
    references = method._references(teacher)
    assert references.shape == teacher.shape
    assert torch.equal(references.flatten(0, 1).sort(dim=0).values,
                       teacher.flatten(0, 1).sort(dim=0).values)
    assert not torch.equal(references, teacher)


def test_a_third_view_that_is_not_a_box_fails_with_one_line() -> None:
    method = _small()
    views = [torch.randn(2, 3, 8, 8, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(ValueError, match="LocatedViews"):
        method.forward_views(views)


def test_located_views_work_with_the_imagenet_preset() -> None:
    """The ImageNet preset starts with the crop (nothing before it), as neco.yaml uses it."""
    views = LocatedViews("imagenet", crop_size=32, crop_scale=(0.25, 1.0))(
        Image.new("RGB", (48, 40), (120, 30, 200)))
    assert [tuple(v.shape) for v in views] == [(3, 32, 32)] * 2 + [(5,)] * 2


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="grid must be >= 1"):
        NeCo(small_convnet(), grid=0)
    with pytest.raises(ValueError, match="steepnesses must be > 0"):
        NeCo(small_convnet(), student_steepness=0.0)
