"""DetConLoss against a float64 loop over the paper's equation and against lightly's DetConSLoss
/ DetConBLoss; the mask pooling and the grid and dataset segment masks it is fed with."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from ssl_lightning.data.located_views import map_positions
from ssl_lightning.losses.detcon import DetConLoss, mask_pool
from ssl_lightning.masking.segments import grid_segments, segment_map_weights, view_grid_segments

pytestmark = pytest.mark.usefixtures("one_thread")

TAU = 0.1


def _inputs(seed: int, batch: int = 3, slots: int = 4, absent: bool = True
            ) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(batch, slots, 5, generator=g, dtype=torch.float64) for _ in range(4)]
    low = -1 if absent else 0  # -1: the segment is absent from that view
    ids = [torch.randint(low, 3, (batch, slots), generator=g) for _ in range(2)]
    return vectors, ids


def _loop(pred: list[Tensor], target: list[Tensor], ids: list[Tensor]) -> float:
    """Hénaff et al. Eq. (1)-(2): for segment m of view a of image i, −log of its positive's
    softmax over the other view's segments of all images and its own view's other segments,
    averaged over its positives, divided by the slots sharing its id; summed over both
    directions, averaged over the slots."""
    def unit(x: Tensor) -> list[list[list[float]]]:
        return (x / x.norm(dim=2, keepdim=True)).tolist()

    p, t, s = [unit(x) for x in pred], [unit(x) for x in target], [x.tolist() for x in ids]
    batch, slots = ids[0].shape
    total = 0.0
    for a, b in ((0, 1), (1, 0)):
        for i in range(batch):
            for m in range(slots):
                segment = s[a][i][m]
                positives = [n for n in range(slots) if s[b][i][n] == segment]
                if segment < 0 or not positives:
                    continue

                def sim(vec: list[float], anchor: list[float] = p[a][i][m]) -> float:
                    return sum(x * y for x, y in zip(anchor, vec, strict=True)) / TAU

                candidates = [sim(t[b][j][n]) for j in range(batch) for n in range(slots)
                              if s[b][j][n] >= 0]
                candidates += [sim(t[a][j][n]) for j in range(batch) for n in range(slots)
                               if s[a][j][n] >= 0 and not (j == i and s[a][j][n] == segment)]
                log_norm = math.log(sum(math.exp(c) for c in candidates))
                term = sum(log_norm - sim(t[b][i][n]) for n in positives) / len(positives)
                total += term / sum(1 for n in range(slots) if s[a][i][n] == segment)
    return total / (batch * slots)


@pytest.mark.parametrize("seed", range(4))
def test_detcon_loss_equals_the_float64_loop(seed: int) -> None:
    (p1, p2, t1, t2), (i1, i2) = _inputs(seed)
    loss = DetConLoss(TAU)(p1, p2, t1, t2, i1, i2, i1, i2)
    assert float(loss) == pytest.approx(_loop([p1, p2], [t1, t2], [i1, i2]), rel=1e-12)
    same = DetConLoss(TAU)(p1, p2, p1, p2, i1, i2, i1, i2)  # DetCon-S: targets = anchors
    assert float(same) == pytest.approx(_loop([p1, p2], [p1, p2], [i1, i2]), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_detcon_loss_equals_lightlys_classes(seed: int) -> None:
    from lightly.loss.detcon_loss import DetConBLoss, DetConSLoss
    (p1, p2, t1, t2), (i1, i2) = _inputs(seed, absent=False)  # lightly has no absent segment
    ours = DetConLoss(TAU)
    # lightly computes its label weights (1/positives, 1/slots sharing the id) in float32
    assert float(ours(p1, p2, t1, t2, i1, i2, i1, i2)) == pytest.approx(
        float(DetConBLoss(TAU, gather_distributed=False)(p1, p2, t1, t2, i1, i2)), rel=1e-6)
    assert float(ours(p1, p2, p1, p2, i1, i2, i1, i2)) == pytest.approx(
        float(DetConSLoss(TAU, gather_distributed=False)(p1, p2, i1, i2)), rel=1e-6)


def test_detcon_loss_of_rank_halves_averages_to_the_whole_batch() -> None:
    (p1, p2, t1, t2), (i1, i2) = _inputs(7, batch=4)
    criterion = DetConLoss(TAU)
    whole = criterion(p1, p2, t1, t2, i1, i2, i1, i2)
    halves = [criterion(p1[r:r + 2], p2[r:r + 2], t1, t2, i1[r:r + 2], i2[r:r + 2], i1, i2,
                        offset=r) for r in (0, 2)]
    assert float(sum(halves) / 2) == pytest.approx(float(whole), rel=1e-12)


def test_detcon_loss_refuses_mismatched_shapes() -> None:
    (p1, p2, t1, t2), (i1, i2) = _inputs(0)
    with pytest.raises(ValueError, match="DetConLoss expects anchors"):
        DetConLoss(TAU)(p1, p2[:, :2], t1, t2, i1, i2, i1, i2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        DetConLoss(0.0)


def test_mask_pool_averages_each_segment_and_marks_absent_ones() -> None:
    g = torch.Generator().manual_seed(0)
    locations = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)
    weights = torch.rand(2, 6, 4, generator=g, dtype=torch.float64)
    weights[1, :, 2] = 0  # segment 2 absent from the second image
    pooled, ids = mask_pool(locations, weights)
    for b in range(2):
        for k in range(4):
            area = float(weights[b, :, k].sum())
            expected = sum(float(weights[b, n, k]) * locations[b, n] for n in range(6))
            expected = expected / area if area > 0 else torch.zeros(3, dtype=torch.float64)
            torch.testing.assert_close(pooled[b, k], expected, rtol=1e-12, atol=1e-12)
    assert ids.tolist() == [[0, 1, 2, 3], [0, 1, -1, 3]]


def test_grid_segments_follow_the_views_crop_and_flip() -> None:
    # a 32 px image, 2 x 2 grid; the view covers its right half; a 2 x 2 feature map
    box = torch.tensor([[0.0, 16.0, 32.0, 16.0, 0.0], [0.0, 16.0, 32.0, 16.0, 1.0],
                        [0.0, 0.0, 32.0, 32.0, 1.0]])
    cells = grid_segments(map_positions(box, 2, 2), 32, 2).argmax(dim=2)
    assert cells.tolist() == [[1, 1, 3, 3], [1, 1, 3, 3], [1, 0, 3, 2]]
    assert view_grid_segments(1, 2, 4, 2).argmax(dim=2).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]


def test_segment_maps_become_each_locations_share_of_each_segment() -> None:
    segments = torch.tensor([[[0, 0, 1, 7], [0, 0, 1, 1], [2, 2, 2, 2], [2, 2, 2, 2]]])
    weights = segment_map_weights(segments, 3, 2, 2)  # id 7 is outside the 3 segments
    assert weights[0].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.75, 0.0],
                                   [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="integer segment maps"):
        segment_map_weights(segments.float(), 3, 2, 2)
