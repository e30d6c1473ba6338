"""PaKA (DINOv2PaKA, DINO's ``paka_weight``): the CKA loss against a float64 loop from the
paper's equations and lightly's PatchKernelAlignmentLoss, its invariances, the term inside the
DINO family's loss, the EMA PaKA head, and bad input before training."""

from __future__ import annotations

import pytest
import torch
from lightly.loss.patch_kernel_alignment_loss import PatchKernelAlignmentLoss

from ssl_lightning.backbones import ViT
from ssl_lightning.losses.paka import PaKALoss
from ssl_lightning.methods import DINO, DINOv2PaKA


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
