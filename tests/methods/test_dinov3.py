"""The Gram teacher (snapshot schedule, bicubic resize to the student grid), its crops and the
DINOv3 arguments."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ssl_lightning.backbones import ViT
from ssl_lightning.data import GramCropViews
from ssl_lightning.methods import DINOv3
from ssl_lightning.training.gram_teacher import GramTeacher


def tiny_vit() -> ViT:
    torch.manual_seed(0)
    return ViT(image_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=2, mask_token=True)


def keys_cubic(x: float, a: float = -0.75) -> float:
    """The cubic convolution kernel (Keys 1981) with PyTorch's a = −0.75."""
    x = abs(x)
    if x <= 1:
        return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
    return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a if x < 2 else 0.0


def bicubic_1d(values: list[float], out: int) -> list[float]:
    """Resample with half-pixel centres (align_corners=False), edge samples repeated."""
    n, scale, result = len(values), len(values) / out, []
    for i in range(out):
        src = (i + 0.5) * scale - 0.5
        base, t = math.floor(src), src - math.floor(src)
        taps = [(base + k, keys_cubic(t - k)) for k in (-1, 0, 1, 2)]
        result.append(sum(w * values[min(max(j, 0), n - 1)] for j, w in taps))
    return result


def reference_resize(maps: torch.Tensor, out: int) -> torch.Tensor:
    """(D, h, w) -> (D, out, out), separable bicubic written out."""
    rows = [[bicubic_1d(row.tolist(), out) for row in channel] for channel in maps]
    cols = [[bicubic_1d(list(col), out) for col in zip(*channel, strict=True)] for channel in rows]
    return torch.tensor(cols, dtype=torch.float64).transpose(1, 2)


def test_patch_features_are_bicubically_resized_to_the_student_grid():
    teacher = GramTeacher(tiny_vit().double())
    teacher.refresh(0, teacher.backbone)
    crops = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    got = teacher.patch_features(crops, (4, 4))
    tokens = teacher.backbone.forward_tokens(crops)[:, 1:]  # (2, 64, 8) on the 8×8 grid
    want = torch.stack([reference_resize(t.T.reshape(8, 8, 8), 4).flatten(1).T for t in tokens])
    assert got.shape == (2, 16, 8)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # Known-bad: the teacher run on the crops resized to the student's resolution instead.
    small = teacher.patch_features(F.interpolate(crops, size=16, mode="bicubic"), (4, 4))
    assert (small - want).abs().max() > 1e-2
    # Same grid: the tokens as they are.
    same = teacher.patch_features(crops[..., :16, :16], (4, 4))
    torch.testing.assert_close(same, teacher.backbone.forward_tokens(crops[..., :16, :16])[:, 1:])


def test_snapshots_follow_the_schedule_exactly():
    """Snapshots at start, start + K, ... (at most M refreshes); the snapshot of step s is the
    EMA teacher after s updates, not one before or after (off by one)."""
    ema = torch.nn.Linear(1, 1, bias=False)
    teacher = GramTeacher(ema, start_step=3, refresh_every=4, max_refreshes=2)
    assert [s for s in range(20) if teacher.is_snapshot_step(s)] == [3, 7, 11]
    taken = []
    for step in range(14):
        ema.weight.data.fill_(float(step))  # the EMA teacher after `step` updates
        for _ in range(2):  # gradient accumulation: the second call is a no-op
            if teacher.refresh(step, ema):
                taken.append(step)
        if taken:
            assert teacher.backbone.weight.item() == float(taken[-1])
    assert taken == [3, 7, 11] and teacher.backbone.weight.item() == 11.0
    assert int(teacher.snapshot_step) == 11 and not teacher.backbone.weight.requires_grad
    unlimited = GramTeacher(ema, start_step=0, refresh_every=5, max_refreshes=None)
    assert unlimited.is_snapshot_step(500) and not unlimited.is_snapshot_step(501)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="gram_start_step"):
        GramTeacher(tiny_vit(), start_step=-1)
    with pytest.raises(ValueError, match="no snapshot yet"):
        GramTeacher(tiny_vit()).patch_features(torch.randn(1, 3, 16, 16), (4, 4))
    small = dict(head_out_dim=8, patch_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4,
                 patch_hidden_dim=6, patch_bottleneck_dim=4)
    with pytest.raises(ValueError, match="gram_tokens"):
        DINOv3(tiny_vit(), **small, gram_tokens="cls")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_local_crops"):
        DINOv3(tiny_vit(), **small, num_local_crops=None)
    with pytest.raises(ValueError, match="views"):
        DINOv3(tiny_vit(), **small, num_local_crops=1).forward_views(
            [torch.randn(2, 3, 16, 16)] * 4)
    with pytest.raises(ValueError, match="gram_size"):
        GramCropViews(gram_size=16, global_size=32)


def test_gram_crops_are_the_global_crops_at_a_higher_resolution():
    torch.manual_seed(0)
    image = Image.fromarray((torch.rand(40, 40, 3) * 255).byte().numpy())
    views = GramCropViews(gram_size=32, global_size=16, num_local_crops=1, local_size=8)(image)
    assert [tuple(v.shape[-2:]) for v in views] == [(16, 16), (16, 16), (8, 8), (32, 32), (32, 32)]
    for small, large in ((views[0], views[3]), (views[1], views[4])):
        down = F.interpolate(large[None], size=16, mode="bicubic", antialias=True)[0]
        torch.testing.assert_close(small, down)
    assert (views[0] - F.interpolate(views[4][None], size=16)[0]).abs().max() > 0.1


def test_separate_head_sizes():
    model = DINOv3(tiny_vit(), head_out_dim=8, patch_out_dim=6, head_hidden_dim=10,
                   head_bottleneck_dim=4, patch_hidden_dim=12, patch_bottleneck_dim=5,
                   num_local_crops=1)
    assert model.head.last_layer_parameters()[0].shape == (8, 4)
    widths = [m.out_features for m in model.patch_head.modules() if isinstance(m, torch.nn.Linear)]
    assert widths == [12, 12, 5] and model.patch_head.last_layer_parameters()[0].shape == (6, 5)
    assert model.hparams["betas"] == (0.9, 0.99) and model.hparams["final_lr_ratio"] == 1.0


def test_dinov3_schedules_float64():
    """Gram weight: 0 before the start, then w·(1 − cos(π·k/R))/2 for k = step − start < R, then
    w; the lr multiplier with final_lr_ratio=1 stays at the peak after the warm-up (DINOv3's
    constant schedules)."""
    from ssl_lightning.optim import WarmupCosine

    model = DINOv3(tiny_vit(), head_out_dim=8, patch_out_dim=8, head_hidden_dim=8,
                   head_bottleneck_dim=4, patch_hidden_dim=6, patch_bottleneck_dim=4,
                   num_local_crops=1, gram_weight=2.0, gram_start_step=10,
                   gram_weight_ramp_steps=4)
    want = [0.0] * 10 + [2.0 * (1 - math.cos(math.pi * k / 4)) / 2 for k in range(4)] + [2.0] * 3
    assert [model.gram_weight(s) for s in range(17)] == pytest.approx(want, abs=1e-15)
    factor = WarmupCosine(warmup_steps=5, total_steps=50, final_ratio=1.0)
    assert [factor(s) for s in range(50)] == pytest.approx(
        [(s + 1) / 5 for s in range(5)] + [1.0] * 45, abs=1e-15)
