"""Gradient caching (``micro_batch_size``): exact whole-batch training in micro-batches.

- Every method, BatchNorm-free (SmallConvNet with GroupNorm, heads without BN): 3 optimizer steps
  through the Trainer with micro-batches of 2 give the weights, buffers (queues, centres,
  teachers), logged loss and step features of whole-batch training (batch 8) to 1e-6 relative.
  Naive accumulation (``accumulate_grad_batches=4`` on batches of 2, the loss per micro-batch)
  changes the weights of every batch-coupled method and warns; for BYOL / SimSiam (means of
  per-sample terms) it is exact and silent.
- A ViT with drop path: the gradients equal those of one autograd graph over the same stochastic
  micro-batch forwards (pass 2 replays pass 1's random state).
- 2 processes x 4 samples with micro-batches of 2 (Lightning DDP) equal 1 process x 8.
- Exact resume with micro-batching; ``accumulate_grad_batches`` on top of micro-batching;
  bad input fails before the first step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_ddp_utils import (
    KeyedViews,
    PrecomputedViews,
    TensorDataModule,
    ddp_global_order,
    fit_and_dump,
)
from momentum_utils import fit_and_resume, views_loader
from torch import Tensor
from torch.utils.data import Subset

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.methods import (
    AIM,
    BYOL,
    DCL,
    DINO,
    MMCR,
    MSN,
    NNBYOL,
    NNCLR,
    PMSN,
    WMSE,
    All4One,
    BarlowTwins,
    DeepClusterV2,
    DirectCLR,
    FastSiam,
    LeJEPA,
    MoCoV2,
    MoCoV2Plus,
    MoCoV3,
    NNSiam,
    ReSSL,
    SimCLR,
    SimMIM,
    SimSiam,
    SMoG,
    SSLMethod,
    SupCon,
    SwAV,
    TiCo,
    VIbCReg,
    VICReg,
)
from ssl_lightning.training.grad_cache import grad_cached_loss

OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
TWO_VIEWS, MULTI_CROP = (8, 8), (8, 8, 4, 4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny tensors: one intra-op thread is faster (and fair to a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _backbone() -> SmallConvNet:
    return SmallConvNet((8, 16), norm="group")


def _vit(**kwargs: Any) -> ViT:
    return ViT(image_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=2, **kwargs)


METHODS: dict[str, tuple[Callable[..., SSLMethod], tuple[int, ...]]] = {
    "simclr": (lambda **kw: SimCLR(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                   head_batch_norm=False, **kw), TWO_VIEWS),
    "moco_v2": (lambda **kw: MoCoV2(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                    queue_size=16, symmetric=True, momentum_base=0.9, **kw),
                TWO_VIEWS),
    "moco_v3": (lambda **kw: MoCoV3(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                    projection_layers=2, head_batch_norm=False, **kw), TWO_VIEWS),
    "byol": (lambda **kw: BYOL(_backbone(), projection_hidden_dim=16, projection_dim=8,
                               head_batch_norm=False, momentum_base=0.9, **kw), TWO_VIEWS),
    "dino": (lambda **kw: DINO(_backbone(), head_out_dim=12, head_hidden_dim=16,
                               head_bottleneck_dim=8, clip_grad=0.05, momentum_base=0.9,
                               warmup_teacher_temperature_epochs=0, **kw), MULTI_CROP),
    "swav": (lambda **kw: SwAV(_backbone(), projection_hidden_dim=16, projection_dim=8,
                               num_prototypes=10, head_batch_norm=False,
                               freeze_prototypes_steps=1, queue_size=16, queue_start_epoch=0,
                               **kw), MULTI_CROP),
    "vicreg": (lambda **kw: VICReg(_backbone(), expander_hidden_dim=16, expander_dim=16,
                                   head_batch_norm=False, **kw), TWO_VIEWS),
    "barlow_twins": (lambda **kw: BarlowTwins(_backbone(), projection_hidden_dim=16,
                                              projection_dim=16, head_batch_norm=False,
                                              **kw), TWO_VIEWS),
    "simsiam": (lambda **kw: SimSiam(_backbone(), projection_hidden_dim=16, projection_dim=16,
                                     predictor_hidden_dim=8, head_batch_norm=False, **kw),
                TWO_VIEWS),
    # methods added after the mechanism, through the same base class
    "nnclr": (lambda **kw: NNCLR(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                 predictor_hidden_dim=16, head_batch_norm=False,
                                 queue_size=16, **kw), TWO_VIEWS),
    "dcl": (lambda **kw: DCL(_backbone(), projection_hidden_dim=16, projection_dim=8,
                             head_batch_norm=False, **kw), TWO_VIEWS),
    "supcon": (lambda **kw: SupCon(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                   head_batch_norm=False, **kw), TWO_VIEWS),
    "moco_v2_plus": (lambda **kw: MoCoV2Plus(_backbone(), projection_hidden_dim=16,
                                             projection_dim=8, queue_size=16, **kw), TWO_VIEWS),
    "fastsiam": (lambda **kw: FastSiam(_backbone(), num_views=3, projection_hidden_dim=16,
                                       projection_dim=16, predictor_hidden_dim=8,
                                       head_batch_norm=False, **kw), (8, 8, 8)),
    "nnsiam": (lambda **kw: NNSiam(_backbone(), projection_hidden_dim=16, projection_dim=16,
                                   predictor_hidden_dim=8, head_batch_norm=False, queue_size=16,
                                   **kw), TWO_VIEWS),
    "nnbyol": (lambda **kw: NNBYOL(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                   head_batch_norm=False, momentum_base=0.9, queue_size=16,
                                   **kw), TWO_VIEWS),
    "directclr": (lambda **kw: DirectCLR(_backbone(), loss_dim=8, **kw), TWO_VIEWS),
    "lejepa": (lambda **kw: LeJEPA(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                   head_batch_norm=False, num_slices=16, **kw), MULTI_CROP),
    "tico": (lambda **kw: TiCo(_backbone(), projection_hidden_dim=16, projection_dim=8,
                               head_batch_norm=False, momentum_base=0.9, **kw), TWO_VIEWS),
    "mmcr": (lambda **kw: MMCR(_backbone(), projection_hidden_dim=16, projection_dim=8,
                               head_batch_norm=False, **kw), (8, 8, 8)),
    "wmse": (lambda **kw: WMSE(_backbone(), projection_hidden_dim=16, projection_dim=3,
                               head_batch_norm=False, whitening_size=4, **kw), TWO_VIEWS),
    # IterNorm, like BatchNorm, normalises each micro-batch by its own statistics: off here.
    "vibcreg": (lambda **kw: VIbCReg(_backbone(), expander_hidden_dim=16, expander_dim=16,
                                     head_batch_norm=False, iternorm=False,
                                     covariance_weight=1.0, **kw), TWO_VIEWS),
    # masked-image methods on a ViT: masks / prefixes from the step's CPU stream (no seeds here)
    "simmim": (lambda **kw: SimMIM(_vit(mask_token=True), mask_patch_size=4, image_size=8, **kw),
               (8,)),
    "aim": (lambda **kw: AIM(_vit(), head_hidden_dim=16, head_layers=2, image_size=8, **kw),
            (8,)),
    # Unmasked here (its keyed token dropping is checked in tests/distributed/test_msn_ddp.py).
    "msn": (lambda **kw: MSN(_backbone(), projection_hidden_dim=16, projection_dim=8,
                             num_prototypes=10, head_batch_norm=False, mask_ratio=0.0,
                             momentum_base=0.9, **kw), MULTI_CROP),
    "pmsn": (lambda **kw: PMSN(_backbone(), projection_hidden_dim=16, projection_dim=8,
                               num_prototypes=10, head_batch_norm=False, mask_ratio=0.0,
                               momentum_base=0.9, **kw), MULTI_CROP),
    "ressl": (lambda **kw: ReSSL(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                 queue_size=16, momentum_base=0.9, **kw), TWO_VIEWS),
    "all4one": (lambda **kw: All4One(_backbone(), projection_hidden_dim=16, projection_dim=8,
                                     predictor_hidden_dim=8, head_batch_norm=False,
                                     queue_size=16, neighbours=3, transformer_layers=1,
                                     transformer_heads=2, momentum_base=0.9, **kw), TWO_VIEWS),
    # Dataset indices from the sample seeds (KeyedViews batches), k-means at the epoch start.
    "deepcluster_v2": (lambda **kw: DeepClusterV2(_backbone(), projection_hidden_dim=16,
                                                  projection_dim=8, num_prototypes=(6, 4),
                                                  kmeans_iterations=3, head_batch_norm=False,
                                                  **kw), MULTI_CROP),
    "smog": (lambda **kw: SMoG(_backbone(), projection_hidden_dim=16, projection_dim=8,
                               num_groups=4, reset_every=2, queue_size=16, kmeans_iterations=3,
                               head_batch_norm=False, momentum_base=0.9, **kw), TWO_VIEWS),
}
#: Methods reading each sample's dataset index from its seed (batches with sample seeds).
KEYED = {"deepcluster_v2"}
#: Methods whose smallest global batch exceeds the naive test's batches of 2 (W-MSE: one
#: whitening sub-batch of 4 > D samples); they refuse such a batch before the first step.
MIN_BATCH_ABOVE_TWO = {"wmse"}


#: Micro-batches = whole batch is an exactness check, so it runs in float64 (Lightning's 64-true
#: converts the model and the batches): the runs then differ only by float64 summation order
#: (~1e-14). In fp32 the changed summation order alone (1e-7 per operation, different for each
#: CPU kernel set and thread count) reaches 1.6e-6 (MoCo v3 on AVX-512) to 2e-5 (SwAV's
#: Sinkhorn) in the weights after 3 steps.
TOLERANCE = 1e-10


class RecordSteps(pl.Callback):
    """The ``training_step`` outputs' features and the loss of every step."""

    def __init__(self) -> None:
        self.features: list[Tensor] = []
        self.losses: list[Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.features.append(outputs["features"].clone())
        self.losses.append(outputs["loss"].detach().clone())


def _fit(name: str, batch_size: int, micro: int | None, **trainer_kwargs: Any) -> dict:
    make, sizes = METHODS[name]
    torch.manual_seed(0)
    model = make(micro_batch_size=micro, **OPTIM)
    recorder = RecordSteps()
    data = (KeyedViews if name in KEYED else PrecomputedViews)(24, sizes)
    state = fit_and_dump(model, TensorDataModule(data, batch_size),
                         callbacks=[recorder], max_steps=3,
                         precision="64-true", **trainer_kwargs)[0]
    return {**state, "features": recorder.features, "losses": recorder.losses}


def max_relative_difference(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Largest ``‖a − e‖ / ‖e‖`` over the floating-point tensors of two state dicts (the others
    must be equal)."""
    assert set(actual) == set(expected)
    worst = 0.0
    for key, e in expected.items():
        if e.is_floating_point() and e.numel():
            norm = float(torch.linalg.vector_norm(e.double())) or 1.0
            worst = max(worst, float(torch.linalg.vector_norm((actual[key] - e).double())) / norm)
        else:
            assert torch.equal(actual[key], e), key
    return worst


@pytest.fixture(scope="module")
def whole_batch() -> dict[str, dict]:
    """Whole-batch (8 samples, 3 steps) reference runs of every method."""
    return {name: _fit(name, 8, None) for name in METHODS}


@pytest.mark.parametrize("name", list(METHODS))
def test_micro_batches_equal_whole_batch(name: str, whole_batch: dict[str, dict]) -> None:
    expected = whole_batch[name]
    actual = _fit(name, 8, 2)
    assert actual["global_step"] == expected["global_step"] == 3
    assert max_relative_difference(actual["model"], expected["model"]) < TOLERANCE
    for got, want in zip(actual["features"], expected["features"], strict=True):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(torch.stack(actual["losses"]), torch.stack(expected["losses"]),
                               rtol=TOLERANCE, atol=0)


@pytest.mark.parametrize("name", list(METHODS))
def test_naive_accumulation_changes_coupled_losses_and_warns(
    name: str, whole_batch: dict[str, dict]
) -> None:
    if name in MIN_BATCH_ABOVE_TWO:
        with pytest.raises(ValueError, match="global batch"):
            _fit(name, 2, None, accumulate_grad_batches=4)
        return
    coupled = METHODS[name][0](**OPTIM).batch_coupled_loss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        naive = _fit(name, 2, None, accumulate_grad_batches=4)
    warned = [w for w in caught if "micro_batch_size" in str(w.message)]
    difference = max_relative_difference(naive["model"], whole_batch[name]["model"])
    if coupled:
        assert len(warned) == 1 and "accumulate_grad_batches=4" in str(warned[0].message)
        assert difference > 1e-4
    else:
        assert not warned
    if name in ("byol", "simsiam"):  # means of per-sample terms: plain accumulation is exact
        assert difference < 1e-6


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
    model = METHODS["vicreg"][0]()
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
    model = SimCLR(_backbone(), projection_hidden_dim=16, projection_dim=8)  # BN in the head
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


def test_ddp_two_processes_with_micro_batches_equal_one_process() -> None:
    """2 ranks x 4 samples (micro-batches of 2, through Lightning's DDP reducer) = 1 x 8."""
    data = PrecomputedViews(24)

    def make(micro: int | None) -> SimCLR:
        torch.manual_seed(0)
        return METHODS["simclr"][0](micro_batch_size=micro, **OPTIM)

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
        lambda: METHODS["moco_v2"][0](micro_batch_size=2, **OPTIM),
        lambda: views_loader(n=8, batch_size=4, size=8), str(tmp_path), epochs=2,
    )
    assert max_relative_difference(resumed, full) == 0.0


def test_bad_micro_batch_size_fails_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"micro_batch_size must be > 0 or None, got {bad}"):
            METHODS["simclr"][0](micro_batch_size=bad)
    model = METHODS["simclr"][0](micro_batch_size=3, **OPTIM)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="micro_batch_size=3 .* batch size 8"):
        fit_and_dump(model, TensorDataModule(PrecomputedViews(16), 8), max_steps=1)
    assert max_relative_difference(model.state_dict(), before) == 0.0

    class OwnLoss(SimCLR):
        def training_loss(self, views):  # type: ignore[no-untyped-def]
            return super().training_loss(views)

    with pytest.raises(ValueError, match="implement forward_views"):
        OwnLoss(_backbone(), micro_batch_size=2)
