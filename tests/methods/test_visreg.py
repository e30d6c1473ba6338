"""VISReg: the loss against a float64 loop from the paper's equations and against lightly's
VISRegLoss (values and gradients), the global-batch statistics (rank losses average to the
one-process loss), the step's shared directions, and bad input before training."""

from __future__ import annotations

from statistics import NormalDist

import pytest
import torch
from lightly.loss.visreg_loss import VISRegLoss as LightlyVISRegLoss

from ssl_lightning.losses.visreg import VISRegLoss
from ssl_lightning.methods import VISReg
from ssl_lightning.methods.registry import method_entry


def embeddings(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def unit_directions(dim: int, slices: int, seed: int = 1) -> torch.Tensor:
    directions = embeddings(dim, slices, seed=seed)
    return directions / directions.norm(dim=0)


def reference(z: list, directions: list, lam: float, weights: tuple, eps: float,
              globals_: int = 2) -> float:
    """(1 − λ)·invariance + λ·(w_scale·scale + w_shape·shape + w_center·center), entry by entry
    (z[b][v][d]; each view's batch is one sample set)."""
    n, views, dim, slices = len(z), len(z[0]), len(z[0][0]), len(directions[0])
    invariance = 0.0
    for b in range(n):
        for v in range(views):
            for d in range(dim):
                centre = sum(z[b][g][d] for g in range(globals_)) / globals_
                invariance += (centre - z[b][v][d]) ** 2
    invariance /= n * views * dim
    quantiles = [NormalDist().inv_cdf(i / (n + 1)) for i in range(1, n + 1)]
    scale = shape = center = 0.0
    for v in range(views):
        mean = [sum(z[b][v][d] for b in range(n)) / n for d in range(dim)]
        std = [(sum((z[b][v][d] - mean[d]) ** 2 for b in range(n)) / n) ** 0.5
               for d in range(dim)]
        scale += sum((1 - s) ** 2 for s in std) / dim
        center += sum(m ** 2 for m in mean) / dim
        for m in range(slices):
            projected = sorted(sum((z[b][v][d] - mean[d]) / (std[d] + eps) * directions[d][m]
                                   for d in range(dim)) for b in range(n))
            shape += sum((p - q) ** 2 for p, q in zip(projected, quantiles, strict=True)
                         ) / (n * slices)
    regulariser = (weights[0] * scale + weights[1] * shape + weights[2] * center) / views
    return (1 - lam) * invariance + lam * regulariser


def test_loss_equals_the_float64_loop():
    z, directions = embeddings(7, 3, 5) * 2 + 0.3, unit_directions(5, 4)
    loss = VISRegLoss(0.6, 2, 1.0, 2.0, 0.5, 1e-4)
    value = loss(z, z, directions)
    assert value.dtype == torch.float64
    expected = reference(z.tolist(), directions.tolist(), 0.6, (1.0, 2.0, 0.5), 1e-4)
    assert value.item() == pytest.approx(expected, rel=1e-12)
    # Known-bad: the unbiased standard deviation is a different loss.
    views = z.transpose(0, 1)
    biased = (1 - views.std(dim=1, correction=0)).square().mean()
    unbiased = (1 - views.std(dim=1, correction=1)).square().mean()
    assert abs(0.6 * (unbiased - biased).item()) > 1e-3


def test_loss_and_gradients_equal_lightly_with_its_directions():
    z = (embeddings(6, 4, 8) * 1.5).requires_grad_()
    torch.manual_seed(3)
    lightly = LightlyVISRegLoss(lambda_param=0.9, num_slices=16)(
        global_proj=z[:, :2].transpose(0, 1), local_proj=z[:, 2:].transpose(0, 1))
    (lightly_grad,) = torch.autograd.grad(lightly, z)
    torch.manual_seed(3)  # the same draw as lightly's visreg_shape_loss
    directions = torch.randn(8, 16, dtype=torch.float64)
    directions = directions / directions.norm(dim=0)
    ours = VISRegLoss(0.9)(z, z, directions)
    (grad,) = torch.autograd.grad(ours, z)
    torch.testing.assert_close(ours, lightly, rtol=1e-6, atol=0)  # lightly: fp32 quantiles
    torch.testing.assert_close(grad, lightly_grad, rtol=1e-5, atol=1e-9)


def test_shape_term_stops_the_gradient_of_the_standard_deviation():
    z = embeddings(6, 2, 3).requires_grad_()
    directions = unit_directions(3, 5)
    shape = VISRegLoss().terms(z, z, directions)[2]
    (grad,) = torch.autograd.grad(shape, z)
    views = z.transpose(0, 1)
    mean = views.mean(dim=1, keepdim=True)
    std = views.std(dim=1, correction=0, keepdim=True)  # known-bad: σ not detached
    normalised = (views - mean) / (std + 1e-4)
    quantiles = torch.special.ndtri(torch.arange(1, 7, dtype=torch.float64) / 7).unsqueeze(-1)
    bad = ((normalised @ directions).sort(dim=1).values - quantiles).square().mean()
    (bad_grad,) = torch.autograd.grad(bad, z)
    assert not torch.allclose(grad, bad_grad)


def test_rank_losses_average_to_the_one_process_loss():
    z, directions = embeddings(8, 3, 4), unit_directions(4, 6)
    loss = VISRegLoss(0.7)
    ranks = [loss(half, z, directions) for half in z.chunk(2)]
    torch.testing.assert_close(sum(ranks) / 2, loss(z, z, directions))


def test_directions_are_the_steps_and_shared_by_instances():
    entry = method_entry("visreg")
    first, second = entry.small(), entry.small()
    like = torch.zeros(())
    torch.testing.assert_close(first.directions(8, like), second.directions(8, like))
    assert first.directions(8, like).shape == (8, 16)
    first._batch_idx = 1
    assert not torch.allclose(first.directions(8, like), second.directions(8, like))


@pytest.mark.parametrize("kwargs, match", [
    (dict(lambda_param=1.5), "lambda_param must be in"),
    (dict(lambda_shape=-1.0), "lambda_shape must be >= 0"),
    (dict(num_slices=0), "num_slices must be >= 1"),
    (dict(eps=0.0), "eps must be > 0"),
    (dict(num_global_views=0), "num_global_views must be >= 1"),
])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VISReg(method_entry("visreg").backbone(), **kwargs)


def test_bad_shapes_fail():
    loss = VISRegLoss()
    with pytest.raises(ValueError, match="V >= 2 views"):
        loss(embeddings(4, 1, 3), embeddings(4, 1, 3), unit_directions(3, 2))
    with pytest.raises(ValueError, match="N >= 2"):
        loss(embeddings(1, 2, 3), embeddings(1, 2, 3), unit_directions(3, 2))
    with pytest.raises(ValueError, match="directions must be"):
        loss(embeddings(4, 2, 3), embeddings(4, 2, 3), unit_directions(4, 2))
