"""SimMIMLoss and AIMLoss against float64 references written from the papers' formulas (numpy
loops), their properties and the known-bad variants.

- SimMIM (Xie et al. 2022, eq. 1): ``1/Ω(x_M) · Σ |y_M − x_M|`` over the masked pixels.
- AIM (El-Nouby et al. 2024, §3): per image ``1/(K − S) Σ_{k>S} ‖x̂_k − x_k‖²`` (here averaged over
  a patch's P pixel values) on per-patch normalised targets, then the mean over images.
  Known-bad: raw (unnormalised) targets; the loss over every patch (the prefix too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_lightning.losses import AIMLoss, SimMIMLoss
from ssl_lightning.losses.mae import normalized_patches, patchify


def _normalised(patch: np.ndarray) -> np.ndarray:
    mean = patch.sum() / len(patch)
    var = ((patch - mean) ** 2).sum() / (len(patch) - 1)  # unbiased, as MAE's code
    return (patch - mean) / np.sqrt(var + 1e-6)


def _simmim_reference(pred: np.ndarray, patches: np.ndarray) -> float:
    total, count = 0.0, 0
    for b in range(pred.shape[0]):
        for j in range(pred.shape[1]):
            for k in range(pred.shape[2]):
                total += abs(pred[b, j, k] - patches[b, j, k])
                count += 1
    return total / count


def _aim_reference(pred: np.ndarray, patches: np.ndarray, prefix: list[int], norm: bool) -> float:
    """``pred[b, k − 1]`` predicts patch k; patches k = S..K−1 (0-based) carry the loss."""
    per_image = []
    for b, s in enumerate(prefix):
        terms = []
        for k in range(s, patches.shape[1]):
            target = _normalised(patches[b, k]) if norm else patches[b, k]
            terms.append(sum((pred[b, k - 1, p] - target[p]) ** 2 for p in range(len(target)))
                         / len(target))
        per_image.append(sum(terms) / len(terms))
    return sum(per_image) / len(per_image)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(3, 6, 12, generator=g, dtype=torch.float64, requires_grad=True)
    return pred, 2.0 + 3.0 * torch.randn(3, 7, 12, generator=g, dtype=torch.float64)


def test_simmim_loss_equals_the_loop_reference() -> None:
    pred, patches = _data()
    loss = SimMIMLoss()(pred, patches[:, :6])
    assert loss.dtype == torch.float64
    assert abs(loss.item() - _simmim_reference(pred.detach().numpy(), patches[:, :6].numpy())) \
        < 1e-12
    loss.backward()
    assert pred.grad is not None and patches.grad is None


@pytest.mark.parametrize("norm", [True, False])
def test_aim_loss_equals_the_loop_reference(norm: bool) -> None:
    pred, patches = _data()
    prefix = [1, 3, 6]  # K = 7: 6, 4 and 1 predicted patches
    loss = AIMLoss(norm_pix_loss=norm)(pred, patches, torch.tensor(prefix))
    expected = _aim_reference(pred.detach().numpy(), patches.numpy(), prefix, norm)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected) < 1e-12
    loss.backward()
    assert pred.grad is not None


def test_aim_known_bad_variants_differ() -> None:
    """Raw-pixel targets, and the loss over the prefix patches too, miss the reference."""
    pred, patches = _data()
    prefix = torch.tensor([1, 3, 6])
    expected = _aim_reference(pred.detach().numpy(), patches.numpy(), prefix.tolist(), True)
    raw = AIMLoss(norm_pix_loss=False)(pred, patches, prefix)
    assert abs(raw.item() - expected) > 1e-2
    everything = (pred - normalized_patches(patches[:, 1:])).pow(2).mean()
    assert abs(everything.item() - expected) > 1e-2


def test_aim_loss_ignores_the_predictions_of_prefix_patches() -> None:
    pred, patches = _data()
    prefix = torch.tensor([2, 4, 5])
    loss = AIMLoss()(pred, patches, prefix)
    changed = pred.detach().clone()
    for b, s in enumerate(prefix.tolist()):
        changed[b, :s - 1] += 10.0  # rows 0..S−2 predict prefix patches 1..S−1
    assert torch.equal(AIMLoss()(changed, patches, prefix), loss)
    changed[0, 1] += 1.0  # row S − 1 = 1 predicts patch 2, the first after the prefix
    assert AIMLoss()(changed, patches, prefix) != loss


def test_aim_loss_is_invariant_to_each_target_patch_affine_change() -> None:
    """Per-patch normalisation: a patch's brightness and contrast do not change its target."""
    pred, patches = _data()
    scaled = patches * torch.linspace(0.5, 3.0, 7, dtype=torch.float64).view(1, 7, 1) + 4.0
    prefix = torch.tensor([1, 2, 3])
    torch.testing.assert_close(AIMLoss(eps=1e-12)(pred, scaled, prefix),
                               AIMLoss(eps=1e-12)(pred, patches, prefix), atol=1e-9, rtol=0)


def test_patchify_matches_a_loop() -> None:
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.float64).view(2, 3, 4, 4)
    patches = patchify(images, 2)
    for b in range(2):
        for row in range(2):
            for col in range(2):
                expected = images[b, :, 2 * row:2 * row + 2, 2 * col:2 * col + 2].permute(1, 2, 0)
                assert torch.equal(patches[b, row * 2 + col], expected.reshape(-1))


@pytest.mark.parametrize("prefix", [[0, 1, 2], [1, 7, 2], [1, 2]])
def test_aim_loss_refuses_bad_prefixes(prefix: list[int]) -> None:
    pred, patches = _data()
    with pytest.raises(ValueError, match="prefix must hold"):
        AIMLoss()(pred, patches, torch.tensor(prefix))


def test_bad_shapes_are_refused() -> None:
    pred, patches = _data()
    with pytest.raises(ValueError, match="same shape"):
        SimMIMLoss()(pred, patches)
    with pytest.raises(ValueError, match=r"\(B, K - 1, P\)"):
        AIMLoss()(pred[:, :5], patches, torch.tensor([1, 1, 1]))
