"""PaKA (DINOv2PaKA, DINO's ``paka_weight``): the CKA loss against a float64 loop from the
paper's equations and lightly's PatchKernelAlignmentLoss, its invariances, the term inside the
DINO family's loss, the EMA PaKA head, and bad input before training."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from lightly.loss import roi_resample_to_grid
from lightly.loss.patch_kernel_alignment_loss import PatchKernelAlignmentLoss
from momentum_utils import cpu_trainer
from PIL import Image

from ssl_lightning.backbones import ViT
from ssl_lightning.data import MultiCropViews
from ssl_lightning.data.paka_views import PaKAViews
from ssl_lightning.data.seeding import SeededDataset
from ssl_lightning.losses.paka import PaKALoss, cross_crop_patches
from ssl_lightning.losses.region_align import align_region
from ssl_lightning.methods import DINO, DINOv2PaKA
from ssl_lightning.testing import assert_micro_batches_equal_whole_batch


def tiny_vit() -> ViT:
    return ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, mask_token=True)


def reference_loss(student: torch.Tensor, teacher: torch.Tensor) -> float:
    """Mean over images of 1 − ⟨HK_sH, HK_tH⟩_F / (‖HK_sH‖_F ‖HK_tH‖_F), K = Z Zᵀ, written
    entry by entry."""
    losses = []
    for z_s, z_t in zip(student.tolist(), teacher.tolist(), strict=True):
        n = len(z_s)
        centred = []
        for z in (z_s, z_t):
            k = [[sum(a * b for a, b in zip(z[i], z[j], strict=True)) for j in range(n)]
                 for i in range(n)]
            row = [sum(k[i]) / n for i in range(n)]
            col = [sum(k[i][j] for i in range(n)) / n for j in range(n)]
            total = sum(row) / n
            centred.append([[k[i][j] - row[i] - col[j] + total for j in range(n)]
                            for i in range(n)])
        k_s, k_t = centred

        def inner(a, b, n=n):
            return sum(a[i][j] * b[i][j] for i in range(n) for j in range(n))

        losses.append(1 - inner(k_s, k_t) / (inner(k_s, k_s) * inner(k_t, k_t)) ** 0.5)
    return sum(losses) / len(losses)


def features(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def test_loss_equals_the_float64_loop_and_lightly():
    student, teacher = features(3, 7, 5), features(3, 7, 4, seed=1)
    value = PaKALoss()(student, teacher)
    assert value.dtype == torch.float64
    assert value.item() == pytest.approx(reference_loss(student, teacher), rel=1e-12)
    teacher5 = features(3, 7, 5, seed=1)
    lightly = PatchKernelAlignmentLoss()(student.float(), teacher5.float())
    torch.testing.assert_close(PaKALoss()(student.float(), teacher5.float()), lightly)
    # Known-bad: the kernels without double centring (plain kernel alignment) differ.
    k_s, k_t = student @ student.mT, teacher @ teacher.mT
    uncentred = 1 - (k_s * k_t).sum((1, 2)) / (k_s.norm(dim=(1, 2)) * k_t.norm(dim=(1, 2)))
    assert abs(uncentred.mean().item() - value.item()) > 1e-3


def test_loss_is_zero_for_a_rotated_rescaled_teacher_and_leading_dims_are_images():
    student = features(2, 6, 4)
    rotation, _ = torch.linalg.qr(features(4, 4, seed=2))
    teacher = 3.0 * student @ rotation + 1.5  # scaled, rotated, shifted patches
    assert PaKALoss()(student, teacher).item() == pytest.approx(0.0, abs=1e-12)
    student4, teacher4 = features(2, 3, 6, 4), features(2, 3, 6, 4, seed=3)
    torch.testing.assert_close(PaKALoss()(student4, teacher4),
                               PaKALoss()(student4.flatten(0, 1), teacher4.flatten(0, 1)))


def test_teacher_gets_no_gradient_and_bad_shapes_fail():
    student = features(2, 6, 4).requires_grad_()
    teacher = features(2, 6, 4, seed=1).requires_grad_()
    PaKALoss()(student, teacher).backward()
    assert student.grad is not None and teacher.grad is None
    with pytest.raises(ValueError, match="same images and patches"):
        PaKALoss()(features(2, 6, 4), features(2, 5, 4))
    with pytest.raises(ValueError, match=">= 2 patches"):
        PaKALoss()(features(2, 1, 4), features(2, 1, 4))


def test_method_adds_the_weighted_term_on_ema_projected_patch_tokens():
    torch.manual_seed(0)
    model = DINOv2PaKA(tiny_vit(), head_out_dim=12, head_hidden_dim=16, head_bottleneck_dim=8,
                       patch_out_dim=12, num_local_crops=1, paka_weight=0.5, paka_hidden_dim=16,
                       paka_dim=8).double()
    assert (model.paka_head, model.teacher_paka_head) in model.ema_pairs()
    assert model.paka_head in model.trainable_modules()
    views = [torch.randn(4, 3, s, s, dtype=torch.float64) for s in (16, 16, 8)]
    outputs = model.forward_views(views)
    assert outputs["paka_student"].shape == outputs["paka_teacher"].shape == (4, 2, 16, 8)
    tokens = model.teacher_backbone.forward_tokens(torch.cat(views[:2]))[:, 1:]
    torch.testing.assert_close(outputs["paka_teacher"].transpose(0, 1).flatten(0, 1),
                               model.teacher_paka_head(tokens))
    with_paka = model.loss_from_outputs(outputs)
    model.paka_weight = 0.0
    without = model.loss_from_outputs(outputs)
    paka = PaKALoss()(outputs["paka_student"], outputs["paka_teacher"])
    torch.testing.assert_close(with_paka, without + 0.5 * paka)


@pytest.mark.parametrize("kwargs, match", [
    (dict(paka_weight=-1.0), "paka_weight must be >= 0"),
    (dict(paka_dim=8), "paka_dim only apply with paka_weight > 0"),
    (dict(paka_weight=1.0), "set patch_distillation: true"),
    (dict(paka_weight=1.0, patch_distillation=True, paka_hidden_dim=0),
     "paka_hidden_dim must be >= 1"),
])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DINO(tiny_vit(), head_out_dim=12, head_hidden_dim=16, head_bottleneck_dim=8, **kwargs)


# ------------------------------------------------------------------------ PaKA across crops
def _map(*shape: int, seed: int = 0) -> torch.Tensor:
    return features(*shape, seed=seed)


@pytest.mark.parametrize("flipped", [0.0, 1.0])
def test_cross_crop_patches_pair_the_same_image_positions_and_equal_the_float64_loop(flipped):
    """A local crop (8, 8, 16, 16) of a 32 px global crop: its 2 x 2 patch grid samples the
    centres of the global crop's patches (1..2, 1..2) of its 4 x 4 grid, so the loop pairs
    student patch (i, j) (mirrored back if the local crop is flipped) with teacher patch
    (1 + i, 1 + j)."""
    student_map, teacher_map = _map(3, 5, 2, 2), _map(3, 4, 4, 4, seed=1)
    local = torch.tensor([[8.0, 8.0, 16.0, 16.0, flipped]] * 3, dtype=torch.float64)
    whole = torch.tensor([[0.0, 0.0, 32.0, 32.0, 0.0]] * 3, dtype=torch.float64)
    student, teacher, valid = cross_crop_patches(student_map, local, teacher_map, whole)
    assert valid.all()
    image_student = student_map.flip(-1) if flipped else student_map
    loop_student = torch.tensor([[[image_student[b, c, i, j].item() for c in range(5)]
                                  for i in range(2) for j in range(2)] for b in range(3)],
                                dtype=torch.float64)
    loop_teacher = torch.tensor([[[teacher_map[b, c, 1 + i, 1 + j].item() for c in range(4)]
                                  for i in range(2) for j in range(2)] for b in range(3)],
                                dtype=torch.float64)
    torch.testing.assert_close(student, loop_student, rtol=0, atol=1e-12)
    torch.testing.assert_close(teacher, loop_teacher, rtol=0, atol=1e-12)
    value = PaKALoss()(student, teacher, valid).item()
    assert value == pytest.approx(reference_loss(loop_student, loop_teacher), rel=1e-12)
    # Known-bad: regions not aligned by position (the teacher's whole crop on the same grid).
    unaligned = align_region(teacher_map, None, None, 2)
    assert abs(PaKALoss()(student, unaligned).item() - value) > 1e-3


def test_cross_crop_paka_equals_lightly_trains_alignment_and_lightlys_loss():
    """lightly-train's ``dinov31``: un-flip each patch map, RoI-align both over the shared
    region onto the local grid (lightly's ``roi_resample_to_grid``), drop pairs whose region
    spans less than one local cell, then lightly's PatchKernelAlignmentLoss with that mask."""
    student_map, teacher_map = _map(4, 6, 3, 3).float(), _map(4, 6, 4, 4, seed=1).float()
    local = torch.tensor([[5, 7, 12, 9, 1], [20, 2, 10, 12, 0], [0, 0, 14, 14, 1],
                          [30, 30, 9, 9, 0]], dtype=torch.float32)
    whole = torch.tensor([[2, 3, 28, 26, 0], [4, 0, 30, 28, 1], [3, 3, 25, 29, 1],
                          [0, 0, 31, 31, 0]], dtype=torch.float32)  # the last pair: 1 px
    student, teacher, valid = cross_crop_patches(student_map, local, teacher_map, whole)
    assert valid.tolist() == [True, True, True, False]

    def lightly_train_align(feature_map, box, region):
        feat = torch.where(box[:, 4, None, None, None] > 0.5, feature_map.flip(-1), feature_map)
        size = feature_map.shape[-1]
        rois = torch.stack([(region[:, 1] - box[:, 1]) / box[:, 3] * size,
                            (region[:, 0] - box[:, 0]) / box[:, 2] * size,
                            (region[:, 3] - box[:, 1]) / box[:, 3] * size,
                            (region[:, 2] - box[:, 0]) / box[:, 2] * size], 1).clamp(0, size)
        return roi_resample_to_grid(feat, rois, 3, 3)

    region = torch.stack([torch.maximum(local[:, 0], whole[:, 0]),
                          torch.maximum(local[:, 1], whole[:, 1]),
                          torch.minimum(local[:, 0] + local[:, 2], whole[:, 0] + whole[:, 2]),
                          torch.minimum(local[:, 1] + local[:, 3], whole[:, 1] + whole[:, 3])],
                         1)
    keep = valid[:, None, None]
    torch.testing.assert_close(torch.where(keep, student, 0), torch.where(
        keep, lightly_train_align(student_map, local, region), 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.where(keep, teacher, 0), torch.where(
        keep, lightly_train_align(teacher_map, whole, region), 0), rtol=1e-5, atol=1e-5)
    mask = ~valid[:, None].expand(-1, 9)
    expected = PatchKernelAlignmentLoss()(student, teacher, mask)
    torch.testing.assert_close(PaKALoss()(student, teacher, valid), expected, rtol=1e-5,
                               atol=1e-6)


def _across_model(**kwargs) -> DINOv2PaKA:
    torch.manual_seed(0)
    return DINOv2PaKA(tiny_vit(), **{
        "head_out_dim": 12, "head_hidden_dim": 16, "head_bottleneck_dim": 8, "patch_out_dim": 12,
        "num_local_crops": 1, "paka_hidden_dim": 16, "paka_dim": 8, "paka_views": "across",
        "paka_local_crops": 2, "image_size": 16, **kwargs}).double()


def _images() -> list[Image.Image]:
    return [Image.fromarray((np.random.RandomState(i).rand(24, 24, 3) * 255).astype(np.uint8))
            for i in range(4)]


def _paka_batches(count: int = 1) -> list[tuple]:
    """``count`` batches of 4 images as the train loader gives them: PaKAViews' entries (views
    in float64), targets and sample seeds."""
    transform = PaKAViews(paka_local_crops=2, num_local_crops=1, global_size=16, local_size=8)
    seeded = SeededDataset(_TransformedImages(_images(), transform), seed=0)
    batches = []
    for epoch in range(count):
        items = [seeded[(epoch, i)] for i in range(4)]
        entries = [torch.stack([item[0][v] for item in items]) for v in range(len(items[0][0]))]
        batches.append(([e.double() for e in entries], torch.zeros(4, dtype=torch.long),
                        torch.tensor([item[2] for item in items])))
    return batches


class _TransformedImages(torch.utils.data.Dataset):
    """Images through a transform, as ``(views, target)`` items."""

    def __init__(self, images, transform):
        self.images, self.transform = images, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.transform(self.images[index]), 0


def test_paka_views_keep_the_dino_views_and_cut_paka_crops_inside_their_global_crop():
    transform = PaKAViews(paka_local_crops=3, num_local_crops=2, global_size=16, local_size=8)
    multicrop = MultiCropViews(num_local_crops=2, global_size=16, local_size=8)
    image = _images()[0]
    got = SeededDataset(_TransformedImages([image], transform), seed=5)[(0, 0)][0]
    dino = SeededDataset(_TransformedImages([image], multicrop), seed=5)[(0, 0)][0]
    assert len(got) == 4 + 2 + 3 + 2 + 3
    for v in range(4):  # the same draws as MultiCropViews
        assert torch.equal(got[v], dino[v])
    boxes = got[9:]
    for g in range(2):  # the clean renders: the global crop box, flip and normalisation only
        pipeline = transform._globals[g]
        assert torch.equal(got[4 + g], PaKAViews._render(pipeline, image, boxes[g], False))
    for k in range(3):
        top, left, height, width, _ = boxes[2 + k].tolist()
        p_top, p_left, p_height, p_width, _ = boxes[k % 2].tolist()
        assert p_top <= top and top + height <= p_top + p_height
        assert p_left <= left and left + width <= p_left + p_width
        assert 0.04 <= height * width / (p_height * p_width) <= 0.41
        assert got[6 + k].shape == (3, 8, 8)


def test_paka_across_pairs_each_crop_with_its_global_crop_through_the_heads():
    model = _across_model()
    with torch.no_grad():
        for p in model.teacher_backbone.parameters():
            p.add_(0.05)
    views = _paka_batches()[0][0]
    outputs = model.forward_views(views)
    assert outputs["paka_student"].shape == outputs["paka_teacher"].shape == (4, 2, 4, 8)
    assert outputs["paka_valid"].all()

    def patch_map(backbone, images):
        return backbone.forward_tokens(images)[:, 1:].transpose(1, 2).unflatten(2, (
            images.shape[-2] // 4, images.shape[-1] // 4))

    for k in range(2):
        student, teacher, _ = cross_crop_patches(
            patch_map(model.backbone, views[5 + k]), views[9 + k],
            patch_map(model.teacher_backbone, views[3 + k % 2]), views[7 + k % 2])
        torch.testing.assert_close(outputs["paka_student"][:, k], model.paka_head(student))
        torch.testing.assert_close(outputs["paka_teacher"][:, k],
                                   model.teacher_paka_head(teacher))
        # Known-bad: the other global crop (not the one the PaKA crop was cut from).
        _, wrong, _ = cross_crop_patches(
            patch_map(model.backbone, views[5 + k]), views[9 + k],
            patch_map(model.teacher_backbone, views[3 + (k + 1) % 2]), views[7 + (k + 1) % 2])
        assert not torch.allclose(model.teacher_paka_head(wrong), outputs["paka_teacher"][:, k])
    with_paka = model.loss_from_outputs(outputs)
    model.paka_weight = 0.0
    paka = PaKALoss()(outputs["paka_student"], outputs["paka_teacher"])
    torch.testing.assert_close(with_paka, model.loss_from_outputs(outputs) + paka)


def test_paka_across_micro_batches_equal_the_whole_batch():
    assert_micro_batches_equal_whole_batch(
        lambda **kw: _across_model(lr=0.01, lr_scaling="none", **kw), _paka_batches(2),
        micro_batch_size=2, steps=2)


def test_paka_across_bad_input():
    model = _across_model()
    with pytest.raises(ValueError, match="use train_transform: PaKAViews"):
        model.forward_views(_paka_batches()[0][0][:-1])
    with pytest.raises(ValueError, match="paka_views must be 'same' or 'across'"):
        _across_model(paka_views="cross")
    with pytest.raises(ValueError, match="needs num_local_crops"):
        _across_model(num_local_crops=None)
    with pytest.raises(ValueError, match="PaKALoss valid must have"):
        PaKALoss()(features(2, 6, 4), features(2, 6, 4), torch.ones(3, dtype=torch.bool))


class _DeclaredTransform(pl.LightningDataModule):
    """A data module that declares a train transform; its batches are PaKAViews' (never reached
    when the transform is refused)."""

    def __init__(self, transform) -> None:
        super().__init__()
        self.train_transform = transform

    def train_dataloader(self):
        return [batch[0] for batch in _paka_batches()]


def test_paka_across_refuses_a_transform_without_paka_crops_before_training(tmp_path):
    model = _across_model(lr_scaling="none")
    initial = model.paka_head[0].weight.detach().clone()
    with pytest.raises(ValueError, match="is MultiCropViews: use train_transform PaKAViews"):
        cpu_trainer(str(tmp_path), 1, enable_checkpointing=False).fit(
            model, _DeclaredTransform(MultiCropViews(num_local_crops=1)))
    assert torch.equal(model.paka_head[0].weight, initial)  # no optimiser step was taken
