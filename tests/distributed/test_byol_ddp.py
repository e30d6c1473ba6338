"""BYOL on 2 gloo processes vs one process with the global batch.

BatchNorm-free backbone and heads, float64, deterministic views; rank r gets samples ``r::2``.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import average_gradients_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import BYOL

pytestmark = pytest.mark.slow


def _byol_grads(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = BYOL(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                 head_batch_norm=False, image_size=8).double()
    g = torch.Generator().manual_seed(5)
    views = [torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)[rank::world]
             for _ in range(2)]
    loss, _ = model.training_loss(views)
    loss.backward()
    if world > 1:
        average_gradients_like_ddp(model)
    return {"loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def test_byol_loss_and_gradients_match_single_process() -> None:
    ranks = run_in_processes(_byol_grads, 2)
    single = _byol_grads(0, 1)
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / 2, single["loss"], atol=1e-10,
                               rtol=0)
    assert not any(n.startswith("teacher_") for n in single["grads"])  # target: no gradient
    assert {n.split(".")[0] for n in single["grads"]} == {"backbone", "projector", "predictor"}
    for name, grad in single["grads"].items():
        for result in ranks:
            torch.testing.assert_close(result["grads"][name], grad, atol=1e-10, rtol=0, msg=name)
