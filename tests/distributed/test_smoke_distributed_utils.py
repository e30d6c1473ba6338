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
