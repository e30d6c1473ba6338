"""The losses of MoCo v2+, FastSiam, NNSiam, NNBYOL, DirectCLR and iBOT++ against float64 loop
references written from the papers' equations (numpy, one sample at a time), over two steps
where a queue is involved (step 2 uses what step 1 enqueued). Each has a known-bad variant that
the same comparison catches: MoCo v2+ enqueuing one view only, a FastSiam target that includes
the view itself, iBOT++ normalising the visible term by all patches.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import FastSiamLoss, IBOTPatchLoss, NegativeCosineLoss
from ssl_lightning.methods import NNBYOL, DirectCLR, FastSiam, MoCoV2Plus, NNSiam

B, D, QUEUE = 4, 5, 8


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


class FifoReference:
    """A queue of rows in plain Python: ``put`` overwrites the oldest rows."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.ptr = [r.copy() for r in rows], 0

    def put(self, keys: np.ndarray) -> None:
        for key in keys:
            self.rows[self.ptr] = key.copy()
            self.ptr = (self.ptr + 1) % len(self.rows)

    def nearest(self, z: np.ndarray) -> np.ndarray:
        return self.rows[int(np.argmax([cos(z, r) for r in self.rows]))]


# ------------------------------------------------------------------------------- MoCo v2+
def infonce_reference(q: np.ndarray, k: np.ndarray, negatives: list, t: float) -> float:
    """MoCo Eq. (1) per query: −log e^{q·k+/T} / (e^{q·k+/T} + Σ e^{q·k_i/T}), unit vectors."""
    total = 0.0
    for qi, ki in zip(q, k, strict=True):
        positive = math.exp(unit(qi) @ unit(ki) / t)
        total -= math.log(positive / (positive + sum(math.exp(unit(qi) @ unit(n) / t)
                                                       for n in negatives)))
    return total / len(q)


class _OneQueueEnqueued(MoCoV2Plus):
    """Known-bad: only the view-2 keys are enqueued; the view-1 queue never changes."""

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        loss = (self.criterion(outputs["query1"], outputs["key2"], self.queue.negatives())
                + self.criterion(outputs["query2"], outputs["key1"],
                                 self.queue_view1.negatives())) / 2
        self.queue.enqueue(self.gather_no_grad(outputs["key2"]))
        return loss


def _moco_steps(cls: type, steps: list[dict[str, Tensor]]) -> tuple[list[float], list[float]]:
    model = cls(SmallConvNet((4, 8)), projection_hidden_dim=8, projection_dim=D,
                queue_size=QUEUE, temperature=0.3).double()
    queue2 = FifoReference(model.queue.queue.numpy())
    queue1 = FifoReference(model.queue_view1.queue.numpy())
    got, want = [], []
    for outputs in steps:
        got.append(float(model.loss_from_outputs(outputs)))
        o = {k: v.numpy() for k, v in outputs.items()}
        want.append((infonce_reference(o["query1"], o["key2"], queue2.rows, 0.3)
                     + infonce_reference(o["query2"], o["key1"], queue1.rows, 0.3)) / 2)
        queue2.put(np.stack([unit(k) for k in o["key2"]]))
        queue1.put(np.stack([unit(k) for k in o["key1"]]))
    return got, want


def test_moco_v2_plus_loss_and_per_view_queues_equal_the_loop() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [{"query1": randn(g, B, D), "query2": randn(g, B, D),
              "key1": torch.nn.functional.normalize(randn(g, B, D), dim=1),
              "key2": torch.nn.functional.normalize(randn(g, B, D), dim=1)} for _ in range(3)]
    got, want = _moco_steps(MoCoV2Plus, steps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    bad, _ = _moco_steps(_OneQueueEnqueued, steps)
    assert bad[0] == pytest.approx(want[0], rel=1e-12)  # same first step ...
    assert abs(bad[2] - want[2]) > 1e-4  # ... then the view-1 queue is stale


def test_moco_v2_plus_refuses_the_one_way_loss() -> None:
    with pytest.raises(ValueError, match="symmetric=False"):
        MoCoV2Plus(SmallConvNet((4, 8)), symmetric=False)


# ------------------------------------------------------------------------------- FastSiam
def fastsiam_reference(p: np.ndarray, z: np.ndarray, include_self: bool = False) -> float:
    """Pototzky et al. §3: (1/K) Σ_i −cos(p_i, (1/(K−1)) Σ_{j≠i} z_j), mean over samples."""
    views, batch = p.shape[:2]
    total = 0.0
    for i in range(views):
        others = [j for j in range(views) if include_self or j != i]
        for b in range(batch):
            total -= cos(p[i, b], sum(z[j, b] for j in others) / len(others))
    return total / (views * batch)


@pytest.mark.parametrize("views", [3, 4])
def test_fastsiam_loss_equals_the_loop(views: int) -> None:
    g = torch.Generator().manual_seed(views)
    p, z = randn(g, views, B, D).requires_grad_(), randn(g, views, B, D).requires_grad_()
    loss = FastSiamLoss()(list(p), list(z))
    assert float(loss) == pytest.approx(fastsiam_reference(p.detach().numpy(),
                                                           z.detach().numpy()), rel=1e-12)
    bad = fastsiam_reference(p.detach().numpy(), z.detach().numpy(), include_self=True)
    assert abs(bad - float(loss)) > 1e-3  # the target with the view itself is another loss
    loss.backward()
    assert z.grad is None and p.grad is not None  # stop-gradient on the targets


def test_fastsiam_with_two_views_is_simsiam() -> None:
    g = torch.Generator().manual_seed(1)
    p1, p2, z1, z2 = (randn(g, B, D) for _ in range(4))
    torch.testing.assert_close(FastSiamLoss()([p1, p2], [z1, z2]),
                               NegativeCosineLoss()(p1, p2, z1, z2), rtol=1e-14, atol=1e-14)


def test_fastsiam_refuses_fewer_than_two_views() -> None:
    with pytest.raises(ValueError, match="K >= 2"):
        FastSiamLoss()([torch.randn(B, D)], [torch.randn(B, D)])
    with pytest.raises(ValueError, match="num_views >= 2 .* got 1"):
        FastSiam(SmallConvNet((4, 8)), num_views=1)
    model = FastSiam(SmallConvNet((4, 8)), num_views=3, projection_hidden_dim=8,
                     projection_dim=D, predictor_hidden_dim=8)
    with pytest.raises(ValueError, match="needs 3 views per sample, got 2"):
        model.training_loss([torch.randn(B, 3, 8, 8)] * 2)


# ----------------------------------------------------------------------- NNSiam / NNBYOL
def _nn_steps(model: nn.Module, byol: bool, steps: list[dict[str, Tensor]]):
    support = FifoReference(model.support_set.queue.numpy())
    got, want = [], []
    for outputs in steps:
        got.append(float(model.loss_from_outputs(dict(outputs))))
        o = {k: v.numpy() for k, v in outputs.items()}
        nn1 = [support.nearest(z) for z in o["z1"]]
        nn2 = [support.nearest(z) for z in o["z2"]]
        c1 = np.mean([cos(p, t) for p, t in zip(o["p1"], nn2, strict=True)])
        c2 = np.mean([cos(p, t) for p, t in zip(o["p2"], nn1, strict=True)])
        # NNSiam: D(p1, NN(z2))/2 + D(p2, NN(z1))/2; NNBYOL: (2 − 2cos) + (2 − 2cos)
        want.append(4 - 2 * (c1 + c2) if byol else -(c1 + c2) / 2)
        support.put(np.stack([unit(z) for z in o["z1"]]))
    return got, want


@pytest.mark.parametrize("name", ["nnsiam", "nnbyol"])
def test_nearest_neighbour_targets_equal_the_loop(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    heads = dict(projection_hidden_dim=8, projection_dim=D, queue_size=QUEUE)
    model = (NNSiam(SmallConvNet((4, 8)), predictor_hidden_dim=8, **heads) if name == "nnsiam"
             else NNBYOL(SmallConvNet((4, 8)), **heads)).double()
    steps = [{k: randn(g, B, D) for k in ("p1", "p2", "z1", "z2")} for _ in range(3)]
    got, want = _nn_steps(model, name == "nnbyol", steps)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert int(model.support_set.queue_ptr) == (3 * B) % QUEUE


@pytest.mark.parametrize("cls", [NNSiam, NNBYOL])
def test_nearest_neighbour_methods_refuse_an_empty_support_set(cls: type) -> None:
    with pytest.raises(ValueError, match="queue_size .* must be >= 1, got 0"):
        cls(SmallConvNet((4, 8)), queue_size=0)


# ------------------------------------------------------------------------------ DirectCLR
def nt_xent_reference(z1: np.ndarray, z2: np.ndarray, t: float) -> float:
    """SimCLR Eq. (1) over the 2B anchors: −log e^{s(a,pos)/T} / Σ_{k≠a} e^{s(a,k)/T}."""
    z = np.concatenate([z1, z2])
    n = len(z1)
    total = 0.0
    for a in range(2 * n):
        positive = (a + n) % (2 * n)
        denominator = sum(math.exp(cos(z[a], z[k]) / t) for k in range(2 * n) if k != a)
        total -= math.log(math.exp(cos(z[a], z[positive]) / t) / denominator)
    return total / (2 * n)


def test_directclr_is_nt_xent_on_the_leading_feature_dims() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 12))
    model = DirectCLR(backbone, loss_dim=5, temperature=0.3, image_size=4).double()
    g = torch.Generator().manual_seed(3)
    views = [randn(g, B, 3, 4, 4) for _ in range(2)]
    loss, features = model.training_loss(views)
    with torch.no_grad():
        r1, r2 = (backbone(v).numpy() for v in views)
    assert float(loss) == pytest.approx(nt_xent_reference(r1[:, :5], r2[:, :5], 0.3), rel=1e-12)
    assert features.shape == (B, 12)
    loss.backward()
    weight_grad = backbone[1].weight.grad
    assert weight_grad[:5].abs().sum() > 0 and weight_grad[5:].abs().sum() == 0


def test_directclr_refuses_more_dims_than_the_backbone_has() -> None:
    with pytest.raises(ValueError, match=r"loss_dim must be in \[1, 8\].*got 9"):
        DirectCLR(SmallConvNet((4, 8)), loss_dim=9)


# -------------------------------------------------------------------------------- iBOT++
def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ibot_plus_plus_reference(student, teacher, masks, tau_s, tau_t, w, visible_over_all=False):
    """TIPSv2 iBOT++: per crop image, mean CE over masked patches + w · mean CE over visible
    patches (an empty set contributes 0); then the mean over images and crops (centre 0)."""
    b, v, n, _ = student.shape
    total = 0.0
    for i in range(b):
        for c in range(v):
            ce = [-(softmax(teacher[i, c, p] / tau_t)
                    * (student[i, c, p] / tau_s
                       - math.log(np.exp(student[i, c, p] / tau_s).sum()))).sum()
                  for p in range(n)]
            masked = [ce[p] for p in range(n) if masks[i, c, p]]
            visible = [ce[p] for p in range(n) if not masks[i, c, p]]
            total += sum(masked) / len(masked) if masked else 0.0
            count = n if visible_over_all else len(visible)
            total += w * (sum(visible) / count if visible else 0.0)
    return total / (b * v)


def test_ibot_plus_plus_patch_loss_equals_the_loop() -> None:
    g = torch.Generator().manual_seed(4)
    student, teacher = randn(g, 3, 2, 6, 7), randn(g, 3, 2, 6, 7)
    masks = torch.rand(3, 2, 6, generator=g) < 0.4
    masks[0, 0] = True  # an all-masked crop: no visible term
    masks[1, 1] = False  # an unmasked crop: only the visible term
    args = (student.numpy(), teacher.numpy(), masks.numpy(), 0.1, 0.05)
    loss = IBOTPatchLoss(7, visible_weight=0.5).eval()(student, teacher, masks, 0.05)
    assert float(loss) == pytest.approx(ibot_plus_plus_reference(*args, 0.5), rel=1e-12)
    ibot = IBOTPatchLoss(7).eval()(student, teacher, masks, 0.05)
    assert float(ibot) == pytest.approx(ibot_plus_plus_reference(*args, 0.0), rel=1e-12)
    diluted = ibot_plus_plus_reference(*args, 0.5, visible_over_all=True)
    assert abs(diluted - float(loss)) > 1e-3  # the visible mean is over visible patches only


@pytest.mark.parametrize("kwargs", [dict(visible_weight=-1.0),
                                    dict(visible_weight=1.0, centering="sinkhorn")])
def test_ibot_plus_plus_refuses_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="visible_weight"):
        IBOTPatchLoss(7, **kwargs)
