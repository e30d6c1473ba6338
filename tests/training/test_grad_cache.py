"""Gradient caching (``micro_batch_size``): the mechanism's own checks.

That micro-batches equal the whole batch for every method (with and without sample seeds), and
that naive accumulation changes batch-coupled losses, is a property over the method registry:
``tests/properties/test_micro_batching.py``. Here, on registered small instances:

- A ViT with drop path: the gradients equal those of one autograd graph over the same stochastic
  micro-batch forwards (pass 2 replays pass 1's random state).
- BatchNorm running statistics are updated once per micro-batch; ``loss_scale`` multiplies the
  cached gradients.
- 2 processes x 4 samples with micro-batches of 2 (Lightning DDP) equal 1 process x 8.
- Exact resume with micro-batching; ``accumulate_grad_batches`` on top of micro-batching;
  bad input fails before the first step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from momentum_utils import fit_and_resume, views_loader
from torch import Tensor
from torch.utils.data import Subset

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import SimCLR
from ssl_lightning.methods.registry import method_entry, small_convnet
from ssl_lightning.testing.trainer_runs import (
    PrecomputedViews,
    TensorDataModule,
    ddp_global_order,
    fit_and_dump,
    max_relative_difference,
)
from ssl_lightning.training.grad_cache import grad_cached_loss

OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)


#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


#: float64 exactness (see tests/properties/test_micro_batching.py).
TOLERANCE = 1e-10


def _fit(name: str, batch_size: int, micro: int | None, **trainer_kwargs: Any) -> dict:
    """3 float64 steps of the registered small instance ``name`` on 24 seedless samples."""
    entry = method_entry(name)
    torch.manual_seed(0)
    model = entry.small(micro_batch_size=micro, **OPTIM)
    return fit_and_dump(model, TensorDataModule(PrecomputedViews(24, entry.views), batch_size),
                        max_steps=3, precision="64-true", **trainer_kwargs)[0]


def test_accumulation_on_top_of_micro_batches_counts_each_loader_batch() -> None:
    """micro_batch_size=2 on loader batches of 4, accumulated twice = the same accumulation of
    whole batches of 4 (the cached gradients carry Lightning's 1/accumulate_grad_batches)."""
    plain = _fit("simclr", 4, None, accumulate_grad_batches=2, gradient_clip_val=0.5)
    cached = _fit("simclr", 4, 2, accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert max_relative_difference(cached["model"], plain["model"]) < 1e-6


def test_loss_scale_multiplies_the_cached_gradients() -> None:
    """What the GradScaler / accumulation path relies on: with ``loss_scale`` s, a backward of
    s·loss leaves exactly s × the unscaled gradients (s a power of 2)."""
    torch.manual_seed(0)
    model = method_entry("vicreg").small()
    views = [torch.randn(6, 3, 8, 8) for _ in range(2)]
    scaled = copy.deepcopy(model)
    grad_cached_loss(model, views, 2)[0].backward()
    loss, _ = grad_cached_loss(scaled, views, 2, loss_scale=1024.0)
    (loss * 1024.0).backward()
    for p, q in zip(scaled.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad * 1024.0, rtol=0, atol=0)


def test_batchnorm_running_statistics_are_updated_once_per_micro_batch() -> None:
    """Pass 1's buffer updates are undone: after one cached step the BatchNorm running
    statistics are those of one forward per micro-batch (4 updates, not 8)."""
    torch.manual_seed(0)
    model = SimCLR(small_convnet(), projection_hidden_dim=16, projection_dim=8)  # BN in the head
    views = [torch.randn(8, 3, 8, 8) for _ in range(2)]
    reference = copy.deepcopy(model)
    grad_cached_loss(model, views, 2)[0].backward()
    with torch.no_grad():
        for i in range(0, 8, 2):
            reference.forward_views([v[i:i + 2] for v in views])
    assert int(model.projector.mlp[1].num_batches_tracked) == 4
    for (name, b), r in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, r, rtol=0, atol=0, msg=name)


def test_drop_path_is_replayed_exactly() -> None:
    """Reference: the same micro-batch forwards in one autograd graph (same seed, so the same
    drop-path draws), the whole-batch loss and one backward."""
    torch.manual_seed(0)
    vit = ViT("tiny", image_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              drop_path_rate=0.5)
    model = SimCLR(vit, projection_hidden_dim=16, projection_dim=8,
                   head_batch_norm=False).double()
    views = [torch.randn(8, 3, 8, 8, dtype=torch.float64) for _ in range(2)]
    reference = copy.deepcopy(model)

    torch.manual_seed(1)
    loss, _ = grad_cached_loss(model, views, 2)
    loss.backward()

    def one_graph(seed: int) -> tuple[Tensor, list[Tensor]]:
        reference.zero_grad()
        torch.manual_seed(seed)
        parts = [reference.forward_views([v[i:i + 2] for v in views]) for i in range(0, 8, 2)]
        outputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        whole = reference.loss_from_outputs(outputs)
        whole.backward()
        return whole.detach(), [p.grad.clone() for p in reference.parameters()]

    expected_loss, expected = one_graph(1)
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=TOLERANCE, atol=0)
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=TOLERANCE, atol=TOLERANCE)
    _, other_draws = one_graph(2)  # drop path is live: other draws, other gradients
    changes = [float((a - b).abs().max()) for a, b in zip(expected, other_draws, strict=True)]
    assert max(changes) > 1e-3


@pytest.mark.slow
def test_ddp_two_processes_with_micro_batches_equal_one_process() -> None:
    """2 ranks x 4 samples (micro-batches of 2, through Lightning's DDP reducer) = 1 x 8."""
    data = PrecomputedViews(24)

    def make(micro: int | None) -> SimCLR:
        torch.manual_seed(0)
        return method_entry("simclr").small(micro_batch_size=micro, **OPTIM)

    ddp = fit_and_dump(make(2), TensorDataModule(data, 4), devices=2, max_steps=3,
                       precision="64-true")
    single = fit_and_dump(make(None), TensorDataModule(Subset(data, ddp_global_order(24, 2, 4)),
                                                       8), max_steps=3, precision="64-true")
    # float64 end to end (Lightning's 64-true converts the model and the batches): the two runs
    # differ only by float64 summation order, 8.5e-16 here. A loss that drops float64 to fp32
    # (an earlier NT-Xent ``.float()`` cast) leaves 2.8e-7-3.8e-7 on both the plain and the
    # micro-batched 2-process run, which an fp32-sized tolerance (1e-6) would not see.
    for rank in range(2):
        assert max_relative_difference(ddp[rank]["model"], single[0]["model"]) < 1e-10


def test_exact_resume_with_micro_batches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """MoCo v2 (teacher, queue, symmetric) stopped after epoch 0 and resumed = never stopped."""
    full, resumed = fit_and_resume(
        lambda: method_entry("moco_v2").small(micro_batch_size=2, **OPTIM),
        lambda: views_loader(n=8, batch_size=4, size=8), str(tmp_path), epochs=2,
    )
    assert max_relative_difference(resumed, full) == 0.0


def test_bad_micro_batch_size_fails_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"micro_batch_size must be > 0 or None, got {bad}"):
            method_entry("simclr").small(micro_batch_size=bad)
    model = method_entry("simclr").small(micro_batch_size=3, **OPTIM)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="micro_batch_size=3 .* batch size 8"):
        fit_and_dump(model, TensorDataModule(PrecomputedViews(16), 8), max_steps=1)
    assert max_relative_difference(model.state_dict(), before) == 0.0

    class OwnLoss(SimCLR):
        def training_loss(self, views):  # type: ignore[no-untyped-def]
            return super().training_loss(views)

    with pytest.raises(ValueError, match="implement forward_views"):
        OwnLoss(small_convnet(), micro_batch_size=2)
