"""MAE and I-JEPA under DDP: 2 gloo processes with B/2 samples each give the loss
(mean over ranks) and the DDP-averaged gradients of 1 process with the global batch B. Ranks
share the RNG stream and take their rows of the global batch's masks, so the masks match too."""

from __future__ import annotations

import pytest
import torch
from distributed_utils import average_gradients_like_ddp, run_in_processes
from mim_utils import SIZE, tiny_ijepa, tiny_mae

pytestmark = pytest.mark.slow

FACTORIES = {"mae": tiny_mae, "ijepa": tiny_ijepa}


def _step(rank: int, world_size: int, images: torch.Tensor) -> dict[str, tuple[float, dict]]:
    """Loss and (DDP-averaged) gradients of one step of each method on this rank's rows."""
    results = {}
    for name, factory in FACTORIES.items():
        torch.manual_seed(0)
        model = factory()
        batch = images.shape[0] // world_size
        torch.manual_seed(1)  # as seed_everything: the same stream on every rank
        outputs = model.forward_views([images[rank * batch:(rank + 1) * batch]])
        loss = model.loss_from_outputs(outputs)
        loss.backward()
        if world_size > 1:
            average_gradients_like_ddp(model)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (loss.item(), grads)
    return results


def test_two_processes_equal_one_process_with_the_global_batch() -> None:
    images = torch.randn(8, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    ranks = run_in_processes(_step, 2, images)
    single = _step(0, 1, images)
    for name in FACTORIES:
        loss, grads = single[name]
        rank_losses = [r[name][0] for r in ranks]
        assert abs(sum(rank_losses) / 2 - loss) < 1e-6, name
        assert rank_losses[0] != rank_losses[1]  # the ranks saw different samples and masks
        assert set(ranks[0][name][1]) == set(grads) and len(grads) > 10
        for key, expected in grads.items():
            torch.testing.assert_close(ranks[0][name][1][key], expected, atol=1e-6, rtol=0,
                                       msg=f"{name}: {key}")
