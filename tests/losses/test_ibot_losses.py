"""iBOT patch loss, Sinkhorn centring and KoLeo against float64 loop references written from the
papers' formulas; only masked positions enter the patch loss; the block-mask generator; iBOT++'s
visible-patch term (the known-bad variant that normalises it by all patches is caught)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loss_references import randn

from ssl_lightning.losses import DINOLoss, IBOTPatchLoss, KoLeoLoss
from ssl_lightning.masking import BlockMasking


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def sinkhorn_reference(scores: np.ndarray, temperature: float, iterations: int) -> np.ndarray:
    """DINOv2 §4 / SwAV Alg. 1 in loops: Q = exp(S/τ)ᵀ, rows to 1/K, columns to 1/M, ×M."""
    q = np.exp(scores / temperature).T.copy()  # (K, M)
    k, m = q.shape
    q /= q.sum()
    for _ in range(iterations):
        for row in range(k):
            q[row] /= q[row].sum() * k
        for col in range(m):
            q[:, col] /= q[:, col].sum() * m
    return (q * m).T


def cross_entropy(target: np.ndarray, logits: np.ndarray, temperature: float) -> float:
    log_p = logits / temperature - math.log(np.exp(logits / temperature).sum())
    return float(-(target * log_p).sum())


def patch_loss_reference(student, teacher, masks, centre, tau_s, tau_t, sinkhorn):
    """iBOT Eq. (2): per image the mean over its masked patches, then the mean over images."""
    b, v, n, _ = student.shape
    masked = [(i, c, p) for i in range(b) for c in range(v) for p in range(n) if masks[i, c, p]]
    if sinkhorn:
        codes = sinkhorn_reference(np.stack([teacher[i, c, p] for i, c, p in masked]), tau_t, 3)
        target = {key: codes[r] for r, key in enumerate(masked)}
    total = 0.0
    for i in range(b):
        for c in range(v):
            terms = [cross_entropy(target[(i, c, p)] if sinkhorn else
                                   softmax((teacher[i, c, p] - centre) / tau_t),
                                   student[i, c, p], tau_s)
                     for p in range(n) if masks[i, c, p]]
            total += sum(terms) / len(terms) if terms else 0.0
    return total / (b * v)


@pytest.fixture(scope="module")
def patches():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 2, 5, 7, generator=g, dtype=torch.float64)
    teacher = torch.randn(3, 2, 5, 7, generator=g, dtype=torch.float64)
    masks = torch.rand(3, 2, 5, generator=g) < 0.5
    masks[0, 1] = False  # an image without masked patches contributes 0
    masks[1, 0] = True
    return student, teacher, masks


@pytest.mark.parametrize("centering", ["center", "sinkhorn"])
def test_patch_loss_matches_loop_reference(patches, centering):
    student, teacher, masks = patches
    loss_fn = IBOTPatchLoss(7, student_temperature=0.1, center_momentum=0.9, centering=centering)
    centre = torch.randn(1, 7, generator=torch.Generator().manual_seed(1))
    loss_fn.center.copy_(centre)
    loss = loss_fn(student, teacher, masks, teacher_temperature=0.07)
    expected = patch_loss_reference(student.numpy(), teacher.numpy(), masks.numpy(),
                                    centre[0].double().numpy(), 0.1, 0.07,
                                    centering == "sinkhorn")
    atol = 1e-10 if centering == "center" else 1e-4  # Sinkhorn runs in fp32
    assert loss.item() == pytest.approx(expected, abs=atol, rel=1e-5 if atol > 1e-6 else 1e-10)
    if centering == "center":  # EMA of the mean over all teacher patch tokens
        want = 0.9 * centre + 0.1 * teacher.reshape(-1, 7).mean(0).float()
        torch.testing.assert_close(loss_fn.center, want)
    else:
        assert torch.equal(loss_fn.center, centre)


def test_only_masked_positions_enter_the_patch_loss(patches):
    student, teacher, masks = patches
    loss_fn = IBOTPatchLoss(7).eval()
    student = student.clone().requires_grad_(True)
    loss = loss_fn(student, teacher, masks, 0.05)
    loss.backward()
    assert (student.grad[~masks] == 0).all() and (student.grad[masks] != 0).any()
    changed_student, changed_teacher = student.detach().clone(), teacher.clone()
    changed_student[~masks] = 1e4 * torch.randn_like(changed_student[~masks])
    changed_teacher[~masks] = -1e4
    assert loss_fn(changed_student, changed_teacher, masks, 0.05).item() == pytest.approx(
        loss.item(), abs=1e-12)
    moved = student.detach().clone()
    moved[masks] += torch.randn_like(moved[masks])  # (a constant shift would not show)
    assert abs(loss_fn(moved, teacher, masks, 0.05).item() - loss.item()) > 1e-3
    none = torch.zeros_like(masks)
    for centering in ("center", "sinkhorn"):
        assert IBOTPatchLoss(7, centering=centering)(student, teacher, none, 0.05).item() == 0


def test_dino_loss_sinkhorn_centering_matches_loop_reference():
    g = torch.Generator().manual_seed(2)
    student = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    teacher = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    loss_fn = DINOLoss(6, 0.1, centering="sinkhorn")
    loss = loss_fn(student, teacher, 0.05)
    codes = sinkhorn_reference(torch.cat(teacher).numpy(), 0.05, 3).reshape(2, 4, 6)
    total, pairs = 0.0, 0
    for s in range(3):
        for t in range(2):
            if s != t:
                total += np.mean([cross_entropy(codes[t, i], student[s][i].numpy(), 0.1)
                                  for i in range(4)])
                pairs += 1
    assert loss.item() == pytest.approx(total / pairs, rel=1e-5)
    assert loss_fn.center.abs().sum() == 0  # no EMA centre with Sinkhorn


def test_koleo_matches_loop_reference_and_candidates():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    x[5] = 3 * x[4]  # same direction as row 4: distance 0 after normalisation
    xn = (x / x.norm(dim=1, keepdim=True)).numpy()

    def reference(rows, candidates, offset):
        out = []
        for i in rows:
            d = min(np.linalg.norm(xn[i] - xn[j]) for j in candidates if j != i)
            out.append(-math.log(d + 1e-8))
        return float(np.mean(out))

    koleo = KoLeoLoss()
    assert koleo(x).item() == pytest.approx(reference(range(6), range(6), 0), rel=1e-12)
    # This rank's rows 2..3 against all 6 candidates (the gathered batch).
    assert koleo(x[2:4], x, offset=2).item() == pytest.approx(
        reference(range(2, 4), range(6), 2), rel=1e-12)
    with pytest.raises(ValueError, match="candidates"):
        koleo(x[:1])


def test_block_masks_ratio_probability_blocks_and_rng_replay():
    generator = BlockMasking(ratio=(0.1, 0.5), probability=0.5)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    masks = generator(400, (8, 8))
    torch.set_rng_state(state)
    assert torch.equal(generator(400, (8, 8)), masks)  # replaying the RNG state replays masks
    counts = masks.sum(1)
    assert masks.shape == (400, 64) and masks.dtype == torch.bool
    assert 0.4 < (counts > 0).float().mean() < 0.6
    assert counts.max() <= 32 and counts[counts > 0].min() >= 4
    assert 0.25 < counts[counts > 0].float().mean() / 64 < 0.32  # mean of U(0.1, 0.5) = 0.3
    full = BlockMasking(ratio=(0.5, 0.5), probability=1.0)(50, (8, 8)).sum(1).float()
    assert (full <= 32).all() and full.mean() > 30
    # Blocks: most masked patches have a masked 4-neighbour (random patches would not).
    grid = masks.view(-1, 8, 8)
    padded = torch.nn.functional.pad(grid.float(), (1, 1, 1, 1))
    neighbours = (padded[:, :-2, 1:-1] + padded[:, 2:, 1:-1] + padded[:, 1:-1, :-2]
                  + padded[:, 1:-1, 2:])
    assert (neighbours[grid] > 0).float().mean() > 0.95


@pytest.mark.parametrize("kwargs", [dict(ratio=(-0.1, 0.5)), dict(ratio=(0.2, 1.5)),
                                    dict(ratio=(0.5, 0.1)), dict(probability=1.2),
                                    dict(min_block_patches=0), dict(aspect=(0.0, 1.0))])
def test_block_mask_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        BlockMasking(**kwargs)


@pytest.mark.parametrize("make", [lambda: IBOTPatchLoss(0), lambda: IBOTPatchLoss(4, 0.0),
                                  lambda: IBOTPatchLoss(4, centering="mean"),
                                  lambda: DINOLoss(4, centering="sinkorn"),
                                  lambda: DINOLoss(4, sinkhorn_iterations=0)])
def test_loss_bad_arguments(make):
    with pytest.raises(ValueError):
        make()


def ibot_plus_plus_reference(student, teacher, masks, tau_s, tau_t, w, visible_over_all=False):
    """TIPSv2 iBOT++: per crop image, mean CE over masked patches + w · mean CE over visible
    patches (an empty set contributes 0); then the mean over images and crops (centre 0)."""
    b, v, n, _ = student.shape
    total = 0.0
    for i in range(b):
        for c in range(v):
            ce = [-(softmax(teacher[i, c, p] / tau_t)
                    * (student[i, c, p] / tau_s
                       - math.log(np.exp(student[i, c, p] / tau_s).sum()))).sum()
                  for p in range(n)]
            masked = [ce[p] for p in range(n) if masks[i, c, p]]
            visible = [ce[p] for p in range(n) if not masks[i, c, p]]
            total += sum(masked) / len(masked) if masked else 0.0
            count = n if visible_over_all else len(visible)
            total += w * (sum(visible) / count if visible else 0.0)
    return total / (b * v)


def test_ibot_plus_plus_patch_loss_equals_the_loop() -> None:
    g = torch.Generator().manual_seed(4)
    student, teacher = randn(g, 3, 2, 6, 7), randn(g, 3, 2, 6, 7)
    masks = torch.rand(3, 2, 6, generator=g) < 0.4
    masks[0, 0] = True  # an all-masked crop: no visible term
    masks[1, 1] = False  # an unmasked crop: only the visible term
    args = (student.numpy(), teacher.numpy(), masks.numpy(), 0.1, 0.05)
    loss = IBOTPatchLoss(7, visible_weight=0.5).eval()(student, teacher, masks, 0.05)
    assert float(loss) == pytest.approx(ibot_plus_plus_reference(*args, 0.5), rel=1e-12)
    ibot = IBOTPatchLoss(7).eval()(student, teacher, masks, 0.05)
    assert float(ibot) == pytest.approx(ibot_plus_plus_reference(*args, 0.0), rel=1e-12)
    diluted = ibot_plus_plus_reference(*args, 0.5, visible_over_all=True)
    assert abs(diluted - float(loss)) > 1e-3  # the visible mean is over visible patches only


@pytest.mark.parametrize("kwargs", [dict(visible_weight=-1.0),
                                    dict(visible_weight=1.0, centering="sinkhorn")])
def test_ibot_plus_plus_refuses_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="visible_weight"):
        IBOTPatchLoss(7, **kwargs)
