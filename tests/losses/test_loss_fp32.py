"""fp32 numerics of the losses against float64, and the gathered-candidates contract under a
process group.

- The InfoNCE-style losses at T = 0.07 on a nearly solved batch (loss ~1e-4), dense and chunked:
  fp32 loss and gradient agree with float64 (no cancellation of two ~1/T numbers).
- SupCon with a mix of single and repeated labels matches the loop reference of its equation.
- Sinkhorn-Knopp stays finite and close to float64 when the logits span more than fp32's
  exp() range (one prototype far below the others).
- Two processes: a loss given gathered tensors without ``rank_offset`` refuses them; a loss
  built with ``gather=True`` gathers itself and equals the explicit call; Sinkhorn's shift is
  the same on every rank, so the codes equal the single-process codes of the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from distributed_utils import run_in_processes
from test_contrastive_losses import _supcon_reference
from torch import Tensor

from ssl_lightning.distributed import all_gather_with_grad
from ssl_lightning.losses import (
    DCLLoss,
    InfoNCELoss,
    MoCoV3Loss,
    NNCLRLoss,
    NTXentLoss,
    SupConLoss,
    sinkhorn_knopp,
)

# Measured fp32-vs-float64 noise floor on this batch, worst over the losses and both paths,
# under ATEN_CPU_CAPABILITY=default / avx2 / avx512 and OMP_NUM_THREADS=1 / 2: loss 9.7e-8
# relative, gradient 2.4e-6 of its largest entry over both inputs. Bounds: 1e-6 (10x margin) and
# 1e-5 (4x margin). Subtracting lse - s_pos instead gives >= 5e-5 (loss) and >= 2.7e-5
# (gradient) on the same batch.
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5



def _nt_xent_bank(z1: Tensor, z2: Tensor, chunk_size: int | None) -> Tensor:
    """NT-Xent against a memory bank filled by a first call on unrelated embeddings."""
    loss = NTXentLoss(0.07, chunk_size, memory_bank_size=len(z1), embedding_dim=z1.shape[1])
    g = torch.Generator().manual_seed(5)
    others = torch.randn(z1.shape, generator=g, dtype=torch.float64).to(z1.dtype)
    loss(others.requires_grad_(), others)
    return loss(z1, z2)


def _infonce(query: Tensor, key: Tensor, chunk_size: int | None) -> Tensor:
    """MoCo's InfoNCE against a queue of unrelated negatives."""
    g = torch.Generator().manual_seed(6)
    queue = torch.randn(2 * len(query), query.shape[1], generator=g, dtype=torch.float64)
    return InfoNCELoss(0.07, chunk_size)(query, key, queue.to(query.dtype))


LOSSES: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "nt_xent": lambda a, b, c: NTXentLoss(0.07, c)(a, b),
    "nt_xent_bank": _nt_xent_bank,
    "supcon": lambda a, b, c: SupConLoss(0.07, c)(a, b, torch.arange(len(a))),
    "nnclr": lambda a, b, c: NNCLRLoss(0.07, c)(a, b),
    "moco_v3": lambda a, b, c: MoCoV3Loss(0.07, chunk_size=c)(a, b),
    "infonce": _infonce,
}


def _nearly_solved(n: int = 64, d: int = 256) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    z1 = torch.randn(n, d, generator=g, dtype=torch.float64)
    return z1, z1 + 0.003 * torch.randn(n, d, generator=g, dtype=torch.float64)


def _loss_and_grads(fn: Callable[..., Tensor], *inputs: Tensor) -> tuple[Tensor, list[Tensor]]:
    leaves = [x.detach().requires_grad_() for x in inputs]
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return loss.double(), [g.double() for g in grads if g is not None]


@pytest.mark.parametrize("chunk_size", [None, 16])
@pytest.mark.parametrize("name", list(LOSSES))
def test_fp32_loss_and_gradient_match_float64_at_low_temperature(
    name: str, chunk_size: int | None
) -> None:
    z1, z2 = _nearly_solved()
    fn = LOSSES[name]
    exact, exact_grads = _loss_and_grads(lambda a, b: fn(a, b, chunk_size), z1, z2)
    fp32, fp32_grads = _loss_and_grads(lambda a, b: fn(a, b, chunk_size), z1.float(), z2.float())
    assert 0 < exact.item() < 1e-2
    assert abs(fp32.item() - exact.item()) / exact.item() < LOSS_RTOL, (fp32, exact)
    got, want = torch.cat([g.flatten() for g in fp32_grads]), torch.cat(
        [g.flatten() for g in exact_grads])
    assert ((got - want).abs().max() / want.abs().max()).item() < GRAD_RTOL


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_supcon_with_single_and_repeated_labels_matches_the_reference(
    chunk_size: int | None,
) -> None:
    g = torch.Generator().manual_seed(1)
    z1, z2 = (torch.randn(10, 6, generator=g, dtype=torch.float64) for _ in range(2))
    labels = torch.tensor([0, 1, 2, 2, 3, 3, 3, 4, 5, 6])
    loss = SupConLoss(0.1, chunk_size)(z1, z2, labels)
    expected = _supcon_reference(z1.numpy(), z2.numpy(), labels.numpy(), 0.1)
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-12)


@pytest.mark.parametrize("epsilon", [0.05, 0.02, 0.01])
def test_sinkhorn_is_finite_and_matches_float64_beyond_the_exp_range(epsilon: float) -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(32, 10, generator=g) * 2 - 1
    scores[:, 3] -= 5  # logits span 140-700: a single shift underflows prototype 3's row
    codes = sinkhorn_knopp(scores, epsilon)
    exact = sinkhorn_knopp(scores.double(), epsilon)
    assert torch.isfinite(codes).all()
    # Codes lie in [0, 1]; measured fp32 floor 3.8e-7 absolute, bound 1e-6 (2.5x margin).
    assert (codes.double() - exact).abs().max().item() < 1e-6


def test_gather_true_refuses_gathered_tensors_and_offsets() -> None:
    z1, z2 = _nearly_solved(4, 8)
    with pytest.raises(ValueError, match="gather=True .* pass only the local tensors"):
        NTXentLoss(gather=True)(z1, z2, z1, z2)
    with pytest.raises(ValueError, match="gather=True .* pass only the local tensors"):
        NNCLRLoss(gather=True)(z1, z2, rank_offset=0)


def test_one_process_without_offset_starts_at_row_zero() -> None:
    z1, z2 = _nearly_solved(4, 8)
    extra = torch.cat([z2, z1])
    assert torch.equal(MoCoV3Loss(0.5)(z1, extra), MoCoV3Loss(0.5)(z1, extra, rank_offset=0))


def _two_view_losses(gather: bool) -> dict[str, Callable[..., Tensor]]:
    return {"nt_xent": NTXentLoss(0.2, 4, gather=gather), "dcl": DCLLoss(0.2, 0.5, 4, gather),
            "supcon": SupConLoss(0.2, 4, gather)}


def _ranks_worker(rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(10 + rank)
    z1, z2 = (torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
              for _ in range(2))
    labels = torch.tensor([0, 1, 1, 2]) + rank
    z1_all, z2_all = all_gather_with_grad(z1), all_gather_with_grad(z2)
    labels_all = torch.cat([torch.tensor([0, 1, 1, 2]) + r for r in range(world)])
    offset = 4 * rank
    out: dict[str, Any] = {"errors": {}, "gather_gap": {}}
    explicit, inside = _two_view_losses(False), _two_view_losses(True)
    for name in explicit:
        extra = (labels,) if name == "supcon" else ()
        extra_all = (labels_all,) if name == "supcon" else ()
        try:
            explicit[name](z1, z2, *extra, z1_all, z2_all, *extra_all)
        except ValueError as error:
            out["errors"][name] = str(error)
        want = explicit[name](z1, z2, *extra, z1_all, z2_all, *extra_all, rank_offset=offset)
        got = inside[name](z1, z2, *extra)
        grads = [torch.autograd.grad(x, z1, retain_graph=True)[0] for x in (want, got)]
        out["gather_gap"][name] = max((want - got).abs().item(),
                                      (grads[0] - grads[1]).abs().max().item())
    for name, loss, local in (("nnclr", NNCLRLoss(0.2, 4), z2), ("moco_v3", MoCoV3Loss(0.2), z2)):
        try:
            loss(z1, all_gather_with_grad(local))
        except ValueError as error:
            out["errors"][name] = str(error)
        want = loss(z1, all_gather_with_grad(local), offset)
        got = type(loss)(0.2, gather=True)(z1, local)  # type: ignore[operator]
        out["gather_gap"][name] = (want - got).abs().item()
    scores = torch.rand(16, 5, generator=torch.Generator().manual_seed(3)).double()
    scores[:8, 0] += 6  # prototype 0's maximum is on rank 0, prototype 1's on rank 1
    scores[8:, 1] += 6
    local = scores[8 * rank: 8 * rank + 8]
    out["codes"] = {dtype: sinkhorn_knopp(local.to(dtype), 0.01)
                    for dtype in (torch.float32, torch.float64)}
    out["codes_single"] = sinkhorn_knopp(scores, 0.01)[8 * rank: 8 * rank + 8]
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_in_processes(_ranks_worker, 2)


@pytest.mark.slow
def test_gathered_tensors_without_rank_offset_are_refused(two_ranks) -> None:
    for rank, result in enumerate(two_ranks):
        assert set(result["errors"]) == {"nt_xent", "dcl", "supcon", "nnclr", "moco_v3"}
        for message in result["errors"].values():
            assert f"pass rank_offset=rank * local batch ({4 * rank} here)" in message
            assert "gather=True" in message


@pytest.mark.slow
def test_gather_true_equals_the_explicit_gathered_call(two_ranks) -> None:
    for result in two_ranks:
        assert max(result["gather_gap"].values()) < 1e-12, result["gather_gap"]


@pytest.mark.slow
def test_sinkhorn_shift_is_shared_by_the_ranks(two_ranks) -> None:
    for result in two_ranks:
        codes64, codes32 = result["codes"][torch.float64], result["codes"][torch.float32]
        assert (codes64 - result["codes_single"]).abs().max().item() < 1e-12
        assert torch.isfinite(codes32).all()
        # Logits span ~700 in fp32; same floor and bound as the one-process test above.
        assert (codes32.double() - result["codes_single"]).abs().max().item() < 1e-6
