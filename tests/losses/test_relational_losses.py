"""ReSSLLoss and All4OneLoss equal float64 numpy references written from the papers' formulas
(ReSSL, Zheng et al. 2021, Eq. 4-5: ``−Σ_k softmax(t·Q/τ_t)_k log softmax(z·Q/τ_s)_k``; All4One,
Estepa et al. 2023: NNCLR-style neighbour and centroid cross-entropies and the feature-wise
redundancy of column-normalised cross-correlations, loops over entries). Properties: no
gradient reaches the teacher; ReSSL's gradient vanishes when the student's distribution is the
teacher's; ``R = 0`` for identical orthonormal columns; gradients match finite differences.
Known-bad variants (swapped ReSSL temperatures, an All4One centroid term without the gradient
into its anchors, a feature term normalised per row) are told apart from the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_lightning.losses import All4OneLoss, FeatureRedundancyLoss, NNCLRLoss, ReSSLLoss


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def ressl_reference(student: np.ndarray, teacher: np.ndarray, queue: np.ndarray, tau_s: float,
                    tau_t: float) -> float:
    q = _unit(queue)
    total = 0.0
    for s, t in zip(_unit(student), _unit(teacher), strict=True):
        target = np.exp(_log_softmax(q @ t / tau_t))
        total -= float((target * _log_softmax(q @ s / tau_s)).sum())
    return total / len(student)


def nnclr_reference(anchors: np.ndarray, candidates: np.ndarray, offset: int, tau: float) -> float:
    a, c = _unit(anchors), _unit(candidates)
    return -float(np.mean([_log_softmax(c @ a[i] / tau)[offset + i] for i in range(len(a))]))


def correlation_reference(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    dim = t.shape[1]
    c = np.zeros((dim, dim))
    for i in range(dim):
        for j in range(dim):
            c[i, j] = (t[:, i] * s[:, j]).sum() / np.sqrt((t[:, i] ** 2).sum()
                                                          * (s[:, j] ** 2).sum())
    return c


def feature_reference(t1: np.ndarray, s2: np.ndarray, t2: np.ndarray, s1: np.ndarray) -> float:
    c1, c2 = correlation_reference(t1, s2), correlation_reference(t2, s1)
    off = ~np.eye(len(c1), dtype=bool)
    on = ((np.diag(c1) - 1) ** 2).mean() / 2 + ((np.diag(c2) - 1) ** 2).mean() / 2
    off_value = (c1[off] ** 2).mean() / 2 + (c2[off] ** 2).mean() / 2
    return 0.5 * np.sqrt(on) + 0.5 * np.sqrt(off_value)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_ressl_loss_equals_reference() -> None:
    student, teacher, queue = _randn(6, 5, seed=0), _randn(6, 5, seed=1), _randn(9, 5, seed=2)
    loss = ReSSLLoss(0.1, 0.04)(student, teacher, queue)
    want = ressl_reference(student.numpy(), teacher.numpy(), queue.numpy(), 0.1, 0.04)
    assert float(loss) == pytest.approx(want, rel=1e-12)
    swapped = ressl_reference(student.numpy(), teacher.numpy(), queue.numpy(), 0.04, 0.1)
    assert abs(swapped - want) > 1e-3  # the known-bad variant is told apart


def test_ressl_gradient_only_to_student_and_zero_at_the_target() -> None:
    student = _randn(4, 5, seed=3).requires_grad_()
    teacher = _randn(4, 5, seed=4).requires_grad_()
    queue = _randn(8, 5, seed=5)
    ReSSLLoss(0.1, 0.04)(student, teacher, queue).backward()
    assert teacher.grad is None and student.grad is not None and student.grad.abs().max() > 0
    same = teacher.detach().clone().requires_grad_()
    ReSSLLoss(0.07, 0.07)(same, teacher.detach(), queue).backward()
    assert same.grad is not None and same.grad.abs().max() < 1e-12
    assert torch.autograd.gradcheck(lambda s: ReSSLLoss()(s, teacher.detach(), queue),
                                    (student.detach().clone().requires_grad_(),))


def _all4one_inputs(batch: int = 5, world_batch: int = 10, dim: int = 4):
    names = ["nn1", "nn2", "p1", "p2", "c1", "c2", "s1", "s2", "t1", "t2", "z1", "z2"]
    rows = {"p1": world_batch, "p2": world_batch, "s1": world_batch, "s2": world_batch}
    return {n: _randn(rows.get(n, batch), dim, seed=10 + i) for i, n in enumerate(names)}


def _all4one(x: dict, offset: int, loss: All4OneLoss | None = None) -> torch.Tensor:
    loss = loss or All4OneLoss(temperature=0.2, centroid_temperature=0.1, chunk_size=None)
    return loss((x["nn1"], x["nn2"]), (x["p1"], x["p2"]), (x["c1"], x["c2"]), (x["s1"], x["s2"]),
                (x["t1"], x["t2"]), (x["z1"], x["z2"]), rank_offset=offset)


def test_all4one_loss_equals_reference() -> None:
    x = _all4one_inputs()
    n = {k: v.numpy() for k, v in x.items()}
    offset = 5
    nn_term = (nnclr_reference(n["nn1"], n["p2"], offset, 0.2)
               + nnclr_reference(n["nn2"], n["p1"], offset, 0.2)) / 2
    centroid = (nnclr_reference(n["c1"], n["s2"], offset, 0.1)
                + nnclr_reference(n["c2"], n["s1"], offset, 0.1)) / 2
    feature = feature_reference(n["t1"], n["z2"], n["t2"], n["z1"])
    want = 0.5 * nn_term + 0.5 * centroid + 5.0 * feature
    assert float(_all4one(x, offset)) == pytest.approx(want, rel=1e-12)
    chunked = _all4one(x, offset, All4OneLoss(chunk_size=2))
    assert float(chunked) == pytest.approx(want, rel=1e-12)


def test_all4one_gradients() -> None:
    x = _all4one_inputs()
    for key in ("c1", "s2", "p1", "z1", "t1", "nn1"):
        x[key].requires_grad_()
    _all4one(x, 0).backward()
    for key in ("c1", "s2", "p1", "z1"):  # the centroid anchors get a gradient, unlike NNCLR's
        assert x[key].grad is not None and x[key].grad.abs().max() > 0, key
    assert x["t1"].grad is None and x["nn1"].grad is None
    detached = NNCLRLoss(0.1, None)(x["c1"], x["s2"], 0)  # known-bad: NNCLR's detached anchor
    x["c1"].grad = None
    detached.backward()
    assert x["c1"].grad is None
    leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items() if k in ("c1", "z2")}

    def loss(c1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        return _all4one({**{k: v.detach() for k, v in x.items()}, "c1": c1, "z2": z2}, 0)

    assert torch.autograd.gradcheck(loss, (leaves["c1"], leaves["z2"]))


def test_feature_term_closed_form_and_row_normalisation_is_wrong() -> None:
    columns, _ = torch.linalg.qr(_randn(8, 4, seed=30))  # orthonormal columns: C = I
    scaled = columns * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert float(FeatureRedundancyLoss()(columns, scaled, scaled, columns)) < 1e-12
    t, s = _randn(6, 4, seed=31), _randn(6, 4, seed=32)
    want = feature_reference(t.numpy(), s.numpy(), s.numpy(), t.numpy())
    assert float(FeatureRedundancyLoss()(t, s, s, t)) == pytest.approx(want, rel=1e-12)
    rows = feature_reference(_unit(t.numpy()), _unit(s.numpy()), _unit(s.numpy()),
                             _unit(t.numpy()))
    unnormalised = FeatureRedundancyLoss()(t, s, s, t)
    assert float(unnormalised) == pytest.approx(float(FeatureRedundancyLoss()(
        t * 3, s * 2, s * 2, t * 3)), rel=1e-12)  # invariant to a column scale
    assert abs(rows - want) > 1e-6  # known-bad: statistics over the rows instead


@pytest.mark.parametrize("make, message", [
    (lambda: ReSSLLoss(student_temperature=0), "student_temperature"),
    (lambda: ReSSLLoss(teacher_temperature=-1), "teacher_temperature"),
    (lambda: All4OneLoss(feature_weight=-1), "feature_weight"),
    (lambda: All4OneLoss(temperature=0), "temperature"),
])
def test_bad_settings_are_refused(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        ReSSLLoss()(_randn(4, 5, seed=0), _randn(4, 5, seed=1), _randn(8, 3, seed=2))
    with pytest.raises(ValueError, match="four"):
        FeatureRedundancyLoss()(_randn(4, 5, seed=0), _randn(4, 5, seed=1), _randn(4, 5, seed=2),
                                _randn(3, 5, seed=3))
