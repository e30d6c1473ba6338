"""The process-spawning helper itself: ranks, world size and a gradient-carrying gather."""

import pytest
import torch
from distributed_utils import run_in_processes

from ssl_lightning.distributed import all_gather_with_grad

pytestmark = pytest.mark.slow


def _gather_rank(rank: int, world_size: int) -> torch.Tensor:
    x = torch.full((2, 1), float(rank), requires_grad=True)
    gathered = all_gather_with_grad(x)
    (gathered * torch.arange(1.0, 5.0).unsqueeze(1)).sum().backward()
    return torch.cat([gathered.detach().flatten(), x.grad.flatten()])


def test_all_gather_with_grad_sums_gradients_over_ranks() -> None:
    results = run_in_processes(_gather_rank, 2)
    for rank, result in enumerate(results):
        assert torch.equal(result[:4], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        # Every rank backpropagates weights 1..4 through the gathered tensor, so this rank's
        # slice receives the sum over the 2 ranks: 2 × its own weights.
        expected = 2 * torch.arange(1.0, 5.0)[2 * rank : 2 * rank + 2]
        assert torch.equal(result[4:], expected)


def _gather_transposed_mean(rank: int, world_size: int) -> torch.Tensor:
    x = torch.arange(6.0).reshape(3, 2).add(10.0 * rank).requires_grad_()
    gathered = all_gather_with_grad(x)  # (6, 2); the loss's gradient reaches it transposed
    (gathered.t().mean(dim=1).square().sum() + gathered.t()[0].square().sum()).backward()
    return x.grad


def test_all_gather_with_grad_with_non_contiguous_gradients() -> None:
    """A gradient that reaches the gathered tensor transposed or expanded (a ``mean``'s backward)
    arrives summed over ranks as a contiguous one does (gloo's all-to-all read such gradients
    in the wrong order)."""
    results = run_in_processes(_gather_transposed_mean, 2)
    full = torch.cat([torch.arange(6.0).reshape(3, 2) + 10.0 * r for r in range(2)])
    full.requires_grad_()
    (full.t().mean(dim=1).square().sum() + full.t()[0].square().sum()).backward()
    for rank, grad in enumerate(results):
        # Each rank backpropagates the whole loss, so its slice gets 2 × the one-process gradient.
        torch.testing.assert_close(grad, 2 * full.grad[3 * rank:3 * rank + 3])
