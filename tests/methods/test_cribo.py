"""CrIBo: the joint-view clustering, the cycle-consistent retrieval and the object terms against
float64 loops of the paper's equations (Lebailly et al., ICLR 2024, §3), and the method's step."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.clustering.joint_views import joint_view_clusters
from ssl_lightning.losses.cribo import CrIBoLoss, cycle_consistent_neighbours
from ssl_lightning.methods import CrIBo
from ssl_lightning.methods.registry import method_entry, small_vit
from ssl_lightning.queues.object_queue import ObjectQueue

D64 = torch.float64


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else [0.0] * len(v)


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _reference_clusters(z1: torch.Tensor, z2: torch.Tensor, init: list[int], rounds: int,
                        sinkhorn: int, lam: float, joint: bool = True) -> list[int]:
    """Cluster of each of the 2N tokens of one image, element by element: the cost −z·c
    rescaled to [0, 1], P = exp(−λM)/ΣP, Sinkhorn rows → 1/T, columns → the marginal, argmax,
    marginal ← sizes + 0.01 normalised, centroids ← normalised member sums. ``joint=False``
    (known-bad) clusters each view on its own."""
    if not joint:
        n = z1.shape[0]
        half = [i for i in init if i < n] or [0]
        first = _reference_clusters(z1, z1, half, rounds, sinkhorn, lam)[:n]
        second = _reference_clusters(z2, z2, half, rounds, sinkhorn, lam)[:n]
        return first + second
    tokens = [_unit(row) for row in torch.cat([z1, z2]).tolist()]
    count, k = len(tokens), len(init)
    cents = [list(tokens[i]) for i in init]
    marginal = [1.0 / k] * k
    labels = [0] * count
    for _ in range(rounds):
        cost = [[-_dot(t, c) for c in cents] for t in tokens]
        low = min(min(r) for r in cost)
        high = max(max(r) for r in cost)
        cost = [[(x - low) / (high - low) for x in r] for r in cost]
        plan = [[math.exp(-lam * x) for x in r] for r in cost]
        total = sum(sum(r) for r in plan)
        plan = [[x / total for x in r] for r in plan]
        for _ in range(sinkhorn):
            plan = [[x / sum(r) / count for x in r] for r in plan]
            cols = [sum(plan[n][j] for n in range(count)) for j in range(k)]
            plan = [[plan[n][j] * marginal[j] / cols[j] for j in range(k)] for n in range(count)]
        labels = [max(range(k), key=lambda j, r=r: r[j]) for r in plan]
        sizes = [labels.count(j) + 1e-2 for j in range(k)]
        marginal = [s / sum(sizes) for s in sizes]
        cents = [_unit([sum(tokens[n][d] for n in range(count) if labels[n] == j)
                        for d in range(len(tokens[0]))]) for j in range(k)]
    return labels


def test_joint_view_clusters_equal_the_loop_and_name_one_object_in_both_views() -> None:
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 5, generator=gen, dtype=D64)
    z1 = centres[torch.tensor([0, 0, 1, 2, 2, 1])] + 0.3 * torch.randn(6, 5, generator=gen,
                                                                      dtype=D64)
    z2 = centres[torch.tensor([1, 2, 2, 0, 1, 0])] + 0.3 * torch.randn(6, 5, generator=gen,
                                                                      dtype=D64)
    init = [0, 2, 3]
    hard = joint_view_clusters(z1[None], z2[None], torch.tensor([init]), 5, 5, 20.0)
    expected = _reference_clusters(z1, z2, init, 5, 5, 20.0)
    assert hard.argmax(dim=2)[0].tolist() == expected
    assert hard.sum(dim=2).eq(1).all()
    # the known-bad variant (each view clustered alone) does not give these clusters
    assert _reference_clusters(z1, z2, init, 5, 5, 20.0, joint=False) != expected


def _reference_retrieval(queries, qvalid, own, partners, pvalid, bank_q, bank_p, bvalid,
                         cycle: bool = True) -> tuple[list[int], list[bool]]:
    """Per query: argmax cosine over the valid bank slots; consistent when the slot's
    other-view vector's argmax cosine over the valid partners is the query's own object."""
    index, ok = [], []
    for m, q in enumerate(queries.tolist()):
        slots = [i for i in range(len(bank_q)) if bvalid[i]]
        if not slots:
            index.append(0)
            ok.append(False)
            continue
        best = max(slots, key=lambda i: _dot(_unit(q), _unit(bank_q[i].tolist())))
        other = _unit(bank_p[best].tolist())
        back = max((p for p in range(len(partners)) if pvalid[p]),
                   key=lambda p: _dot(other, _unit(partners[p].tolist())))
        index.append(best)
        ok.append(bool(qvalid[m]) and (back == int(own[m]) or not cycle))
    return index, ok


def _retrieval_inputs():
    gen = torch.Generator().manual_seed(1)
    partners = torch.randn(6, 4, generator=gen, dtype=D64)
    queries = partners[:4] + 0.2 * torch.randn(4, 4, generator=gen, dtype=D64)
    bank_q = torch.randn(8, 4, generator=gen, dtype=D64)
    bank_p = torch.randn(8, 4, generator=gen, dtype=D64)
    bank_p[:3] = partners[:3] + 0.05 * torch.randn(3, 4, generator=gen, dtype=D64)
    bank_q[:3] = queries[:3] + 0.05 * torch.randn(3, 4, generator=gen, dtype=D64)
    bank_q[3] = queries[3] + 0.05 * torch.randn(4, generator=gen, dtype=D64)  # no cycle back
    qvalid = torch.tensor([True, True, False, True])
    pvalid = torch.tensor([True, True, True, True, True, False])
    bvalid = torch.tensor([True] * 7 + [False])
    return queries, qvalid, torch.arange(4), partners, pvalid, bank_q, bank_p, bvalid


def test_cycle_consistent_neighbours_equal_the_loop() -> None:
    inputs = _retrieval_inputs()
    index, consistent = cycle_consistent_neighbours(*inputs)
    expected_index, expected_ok = _reference_retrieval(*inputs)
    assert index.tolist() == expected_index
    assert consistent.tolist() == expected_ok
    assert consistent.tolist() == [True, True, False, False]  # both kinds occur
    # known-bad: the nearest neighbour without the cycle condition keeps query 3
    assert _reference_retrieval(*inputs, cycle=False)[1] != consistent.tolist()


def test_an_empty_bank_gives_no_neighbour() -> None:
    queries, qvalid, own, partners, pvalid, bank_q, bank_p, _ = _retrieval_inputs()
    _, consistent = cycle_consistent_neighbours(queries, qvalid, own, partners, pvalid, bank_q,
                                                bank_p, torch.zeros(8, dtype=torch.bool))
    assert not consistent.any()


def _h(t: list[float], s: list[float], center: list[float], tt: float, ts: float) -> float:
    """H(t, s) = −Σ softmax((t − C)/τ_t) log softmax(s/τ_s), element by element."""
    a = [(x - c) / tt for x, c in zip(t, center, strict=True)]
    b = [x / ts for x in s]
    za = math.log(sum(math.exp(x - max(a)) for x in a)) + max(a)
    zb = math.log(sum(math.exp(x - max(b)) for x in b)) + max(b)
    return -sum(math.exp(x - za) * (y - zb) for x, y in zip(a, b, strict=True))


def test_object_terms_equal_the_loop_and_the_centre_follows_the_valid_objects() -> None:
    gen = torch.Generator().manual_seed(2)
    batch, k, j = 3, 4, 5
    student = torch.randn(batch, 2, k, j, generator=gen, dtype=D64)
    teacher = torch.randn(batch, 2, k, j, generator=gen, dtype=D64)
    near = torch.randn(batch, 2, k, j, generator=gen, dtype=D64)
    valid = torch.rand(batch, k, generator=gen) < 0.7
    consistent = (torch.rand(batch, 2, k, generator=gen) < 0.5) & valid[:, None]
    loss = CrIBoLoss(j, student_temperature=0.1, center_momentum=0.9).double()
    center = torch.randn(1, j, generator=gen, dtype=D64)
    loss.center.copy_(center)
    cross_view, cross_image = loss(student, teacher, valid, near, consistent, 0.05)
    c = center[0].tolist()
    view_terms, image_terms = [], [[], []]
    for b in range(batch):
        for o in range(k):
            if valid[b, o]:
                view_terms.append((_h(teacher[b, 0, o].tolist(), student[b, 1, o].tolist(), c,
                                      0.05, 0.1)
                                   + _h(teacher[b, 1, o].tolist(), student[b, 0, o].tolist(), c,
                                        0.05, 0.1)) / 2)
            for d in (0, 1):
                if consistent[b, d, o]:  # nn(c_d) is the target of the other view's student
                    image_terms[d].append(_h(near[b, d, o].tolist(),
                                             student[b, 1 - d, o].tolist(), c, 0.05, 0.1))
    assert cross_view.item() == pytest.approx(sum(view_terms) / len(view_terms), rel=1e-12)
    expected_image = sum(sum(t) / len(t) for t in image_terms) / 2
    assert cross_image.item() == pytest.approx(expected_image, rel=1e-12)
    rows = teacher.permute(0, 2, 1, 3)[valid].reshape(-1, j)
    assert torch.allclose(loss.center, 0.9 * center + 0.1 * rows.mean(dim=0), atol=1e-14)


def test_step_fills_the_bank_and_bootstraps_from_the_second_step() -> None:
    torch.manual_seed(0)
    model = method_entry("cribo").small().double()
    views = [torch.randn(4, 3, 8, 8, dtype=D64) for _ in range(2)]
    first = model.forward_views(views)
    assert first["student_objects"].shape == (4, 2, 4, 10)
    model.loss_from_outputs(first).backward()
    assert int(model.object_queue.valid.sum()) == int(first["valid"].sum())
    second = model.forward_views(views)
    pooled, valid = second["teacher_pooled"], second["valid"]
    _, consistent = model.retrieve(pooled, valid, pooled, valid, torch.arange(4), True)
    assert consistent.any()  # the same images: their objects come back through the cycle
    loss = model.loss_from_outputs(second)
    assert torch.isfinite(loss)


def test_bad_arguments_fail_before_training() -> None:
    with pytest.raises(ValueError, match="patch_distillation"):
        CrIBo(small_vit(), head_out_dim=8, object_out_dim=8, patch_distillation=True)
    model = CrIBo(small_vit(), head_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4,
                  object_out_dim=8, num_objects=40, queue_size=4)
    with pytest.raises(ValueError, match="num_objects"):
        model.forward_views([torch.randn(2, 3, 8, 8)] * 2)
    with pytest.raises(ValueError, match="raise queue_size"):
        ObjectQueue(2, 3, 4).enqueue(torch.zeros(3, 2, 3, 4), torch.ones(3, 3, dtype=torch.bool))


def test_local_crops_join_the_cls_loss_only() -> None:
    torch.manual_seed(0)
    model = method_entry("cribo").small(num_local_crops=2).double()
    views = [torch.randn(2, 3, 8, 8, dtype=D64) for _ in range(2)]
    views += [torch.randn(2, 3, 4, 4, dtype=D64) for _ in range(2)]
    outputs = model.forward_views(views)
    assert outputs["student_cls"].shape[:2] == (2, 4)
    assert outputs["student_objects"].shape[:2] == (2, 2)
    assert torch.isfinite(model.loss_from_outputs(outputs))
    with pytest.raises(ValueError, match="2 \\+ 2"):
        model.forward_views(views[:2])


def test_ranks_divide_by_the_global_count_over_the_processes() -> None:
    """Two ranks' losses, each divided by the global counts / 2, average to one process's loss
    on the whole batch (a divisor clamped at 1 broke this when a count was 1 of 2 ranks)."""
    gen = torch.Generator().manual_seed(3)
    student, teacher, near = (torch.randn(4, 2, 3, 5, generator=gen, dtype=D64)
                              for _ in range(3))
    valid = torch.ones(4, 3, dtype=torch.bool)
    consistent = torch.zeros(4, 2, 3, dtype=torch.bool)
    consistent[0, 0, 1] = consistent[3, 1, 2] = consistent[2, 0, 0] = True  # counts 2 and 1
    loss = CrIBoLoss(5).double().eval()
    whole = loss(student, teacher, valid, near, consistent, 0.05)
    counts = (12 / 2, 2 / 2, 1 / 2)
    halves = [loss(student[r::2], teacher[r::2], valid[r::2], near[r::2], consistent[r::2],
                   0.05, counts) for r in range(2)]
    for term in range(2):
        mean = (halves[0][term] + halves[1][term]) / 2
        assert mean.item() == pytest.approx(whole[term].item(), rel=1e-12)
