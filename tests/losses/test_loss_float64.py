"""One dtype rule for DINO, SwAV and Sinkhorn: float64 stays float64, half is promoted to fp32.

The float64 results are compared with the float64 references of the paper formulas (to 1e-12,
which a silent fp32 downcast cannot reach: fp32 rounding alone is ~1e-7 here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dino_loss import crops, dino_reference
from test_sinkhorn import normalized_scores, sinkhorn_reference
from test_swav_loss import swav_reference

from ssl_lightning.losses import DINOLoss, SwAVLoss, sinkhorn_knopp

HALF = [torch.float16, torch.bfloat16]


def test_dino_keeps_float64_and_matches_the_reference():
    student, teacher = crops()
    student, teacher = [s.double() for s in student], [t.double() for t in teacher]
    loss_fn = DINOLoss(6, student_temperature=0.1).double()
    center = loss_fn.center.numpy().copy()
    loss = loss_fn(student, teacher, teacher_temperature=0.04)
    assert loss.dtype == torch.float64 and loss_fn.center.dtype == torch.float64
    expected = dino_reference([s.numpy() for s in student], [t.numpy() for t in teacher],
                              center, 0.1, 0.04)
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-12)


def test_sinkhorn_keeps_float64_and_matches_the_reference():
    scores = normalized_scores(12, 7).double()
    codes = sinkhorn_knopp(scores)
    assert codes.dtype == torch.float64
    np.testing.assert_allclose(codes.numpy(), sinkhorn_reference(scores.numpy()), rtol=1e-12,
                               atol=1e-15)


def test_swav_keeps_float64_and_matches_the_reference():
    scores = [normalized_scores(8, 5, seed=s).double() for s in range(4)]
    loss = SwAVLoss()(scores)
    assert loss.dtype == torch.float64
    np.testing.assert_allclose(loss.item(), swav_reference([s.numpy() for s in scores]),
                               rtol=1e-12)


@pytest.mark.parametrize("dtype", HALF)
def test_half_inputs_give_fp32(dtype):
    student, teacher = crops()
    dino = DINOLoss(6)(
        [s.to(dtype) for s in student], [t.to(dtype) for t in teacher], 0.04)
    scores = [normalized_scores(8, 5, seed=s).to(dtype) for s in range(3)]
    assert dino.dtype == torch.float32
    assert sinkhorn_knopp(scores[0]).dtype == torch.float32
    assert SwAVLoss()(scores).dtype == torch.float32
