"""Franca's Matryoshka heads (DINOv2Matryoshka, DINO's ``matryoshka_levels``): the nested head,
the summed per-level loss against a float64 loop from the paper's equations, the frozen last
layers of every level, and bad input before training."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.backbones import ViT
from ssl_lightning.heads.matryoshka import MatryoshkaDINOHead, matryoshka_widths
from ssl_lightning.losses import DINOLoss
from ssl_lightning.losses.matryoshka import MatryoshkaLoss
from ssl_lightning.methods import DINO, DINOv2Matryoshka

SIZES = [2, 4, 8]


def tiny_vit(**kwargs) -> ViT:
    return ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, mask_token=True,
               **kwargs)


def small(**kwargs) -> DINOv2Matryoshka:
    return DINOv2Matryoshka(tiny_vit(), head_out_dim=16, head_hidden_dim=16,
                            head_bottleneck_dim=8, patch_out_dim=8, num_local_crops=1,
                            matryoshka_levels=3, **kwargs)


def reference_loss(student: list[list[list[float]]], teacher: list[list[list[float]]],
                   centres: list[list[float]], tau_s: float, tau_t: float) -> float:
    """Σ_levels of DINO's mean over samples and crop pairs (s ≠ t) of −Σ_k P_t log P_s, with
    P_t = softmax((g_t − c_l)/τ_t) and P_s = softmax(g_s/τ_s) on each level's slice."""
    total, start = 0.0, 0
    for level, size in enumerate(SIZES):
        cols = range(start, start + size)
        level_sum, pairs = 0.0, 0
        for s_crop, s_rows in enumerate(student):
            for t_crop, t_rows in enumerate(teacher):
                if s_crop == t_crop:
                    continue
                batch_sum = 0.0
                for s_row, t_row in zip(s_rows, t_rows, strict=True):
                    t_exp = [math.exp((t_row[k] - centres[level][k - start]) / tau_t)
                             for k in cols]
                    s_norm = math.log(sum(math.exp(s_row[k] / tau_s) for k in cols))
                    for k, e in zip(cols, t_exp, strict=True):
                        batch_sum -= e / sum(t_exp) * (s_row[k] / tau_s - s_norm)
                level_sum += batch_sum / len(s_rows)
                pairs += 1
        total += level_sum / pairs
        start += size
    return total


def test_summed_level_losses_equal_the_float64_loop_and_update_each_centre():
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(5, sum(SIZES), generator=g, dtype=torch.float64) for _ in range(3)]
    teacher = [torch.randn(5, sum(SIZES), generator=g, dtype=torch.float64) for _ in range(2)]
    loss = MatryoshkaLoss([DINOLoss(k, 0.1, 0.9) for k in SIZES], SIZES).double()
    centres = [torch.randn(1, k, generator=g, dtype=torch.float64) for k in SIZES]
    for level, centre in zip(loss.levels, centres, strict=True):
        level.center.copy_(centre)
    value = loss(student, teacher, 0.05)
    expected = reference_loss([s.tolist() for s in student], [t.tolist() for t in teacher],
                              [c[0].tolist() for c in centres], 0.1, 0.05)
    assert value.item() == pytest.approx(expected, rel=1e-12)
    # Each level's centre moves towards its own slice's mean.
    means = torch.stack(teacher).flatten(0, 1).split(SIZES, dim=-1)
    for level, centre, mean in zip(loss.levels, centres, means, strict=True):
        torch.testing.assert_close(level.center, 0.9 * centre + 0.1 * mean.mean(0, keepdim=True))
    # Known-bad: one softmax over the concatenated levels is a different loss.
    flat = DINOLoss(sum(SIZES), 0.1, 0.9).double()
    flat.center.copy_(torch.cat(centres, dim=-1))
    assert abs(flat(student, teacher, 0.05).item() - expected) > 1e-3


def test_nested_head_levels_read_prefixes_with_proportional_prototypes():
    torch.manual_seed(0)
    head = MatryoshkaDINOHead(16, 32, 12, 6, levels=3).double()
    assert head.widths == [4, 8, 16] and head.out_sizes == [8, 16, 32]
    x = torch.randn(3, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 4:] += 1.0  # only features beyond the narrowest prefix
    out, out_changed = head(x), head(changed)
    assert out.shape == (3, 56)
    torch.testing.assert_close(out[:, :8], out_changed[:, :8])
    assert not torch.allclose(out[:, 8:], out_changed[:, 8:])
    assert len(head.last_layer_parameters()) == 6


def test_method_heads_and_losses_are_nested_and_all_last_layers_freeze():
    torch.manual_seed(0)
    model = small(freeze_last_layer_epochs=1)
    assert isinstance(model.head, MatryoshkaDINOHead)
    assert isinstance(model.patch_head, MatryoshkaDINOHead)
    assert model.criterion.sizes == [4, 8, 16] and model.patch_criterion.sizes == [2, 4, 8]
    views = [torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16), torch.randn(4, 3, 8, 8)]
    outputs = model.forward_views(views)
    assert outputs["student_cls"].shape == (4, 3, 28)
    assert outputs["student_patch"].shape == (4, 2, 16, 14)
    model.loss_from_outputs(outputs).backward()
    model.adjust_gradients_(epoch=0)
    frozen = model.head.last_layer_parameters() + model.patch_head.last_layer_parameters()
    assert all(p.grad is None for p in frozen)
    assert model.head.heads[0].mlp[0].weight.grad is not None


@pytest.mark.parametrize("kwargs, match", [
    (dict(matryoshka_levels=6), "divisible by 32"),
    (dict(matryoshka_levels=0), "matryoshka_levels must be an int >= 1"),
    (dict(matryoshka_levels=3, head_out_dim=2), "0 prototypes"),
])
def test_bad_levels_fail_at_construction(kwargs, match):
    base = dict(head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8, patch_out_dim=8,
                num_local_crops=1)
    with pytest.raises(ValueError, match=match):
        DINOv2Matryoshka(tiny_vit(), **{**base, **kwargs})


def test_batch_norm_heads_are_refused():
    with pytest.raises(ValueError, match="Matryoshka heads have no BatchNorm"):
        DINO(tiny_vit(), head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8,
             head_batch_norm=True, matryoshka_levels=2)


def test_widths_helper():
    assert matryoshka_widths(384, 5) == [24, 48, 96, 192, 384]


def test_plain_dino_with_levels_sums_one_dino_loss_per_level():
    from ssl_lightning.methods.registry import small_convnet

    torch.manual_seed(0)
    model = DINO(small_convnet(), head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8,
                 matryoshka_levels=2, warmup_teacher_temperature_epochs=0).double()
    views = [torch.randn(4, 3, s, s, dtype=torch.float64) for s in (32, 32, 16)]
    outputs = model.forward_views(views)
    expected = sum(
        DINOLoss(size, 0.1).double()(list(s), list(t), 0.07) for size, s, t in zip(
            [8, 16], zip(*(x.split([8, 16], -1) for x in outputs["student"]), strict=True),
            zip(*(x.split([8, 16], -1) for x in outputs["teacher"]), strict=True), strict=True))
    torch.testing.assert_close(model.loss_from_outputs(outputs), expected)
