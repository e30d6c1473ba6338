"""PixPro: the pixel propagation module, the positive pairs by position in the original image and
the pixel-to-propagation loss against a float64 loop of the paper's equations (with two
known-bad variants that the comparison catches), the instance branch, the method's handling of
crop boxes. The registry's property tests (tests/properties) run the method."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from micro_batch_utils import whole_and_micro_batch_gradients
from PIL import Image
from torch import Tensor

from ssl_lightning.data.located_views import LocatedViews
from ssl_lightning.heads.pixel_propagation import PixelPropagation
from ssl_lightning.losses import PixProLoss
from ssl_lightning.losses.dense_matching import position_pairs
from ssl_lightning.methods import PixPro
from ssl_lightning.methods.registry import method_entry, small_convnet

pytestmark = pytest.mark.usefixtures("one_thread")

GRID, DIM, T = 3, 5, 0.7
#: (top, left, height, width, flipped) per sample and view, in pixels of a 32 px image:
#: overlapping crops of two scales, a mirrored view, and two crops that do not meet.
BOXES_1 = [[0, 0, 32, 32, 0], [4, 6, 20, 16, 0], [2, 3, 24, 24, 1], [0, 0, 8, 8, 0]]
BOXES_2 = [[8, 8, 16, 16, 0], [6, 4, 18, 22, 1], [4, 1, 22, 26, 0], [24, 24, 8, 8, 0]]


def _centre(box: list[float], row: int, col: int) -> tuple[float, float]:
    """Where location (row, col) of a GRID x GRID map of the view cut by ``box`` lies in the
    original image (§3.1: the centre of its bin, mirrored inside the box for a flipped view)."""
    top, left, height, width, flipped = box
    x = (col + 0.5) * width / GRID
    return top + (row + 0.5) * height / GRID, left + (width - x if flipped else x)


def _reference_positives(box_a: list[float], box_b: list[float]) -> list[list[bool]]:
    """§3.1: positive when the distance in the original image, over the larger bin diagonal,
    is below T."""
    diagonal = max(math.hypot(b[2] / GRID, b[3] / GRID) for b in (box_a, box_b))
    cells = [(r, c) for r in range(GRID) for c in range(GRID)]
    return [[math.dist(_centre(box_a, *i), _centre(box_b, *j)) < T * diagonal for j in cells]
            for i in cells]


def _cos(a: Tensor, b: Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def _reference_propagation(x: Tensor, g: torch.nn.Linear, gamma: float = 2.0) -> Tensor:
    """Eqs. (2)-(3): y_i = Σ_j max(cos(x_i, x_j), 0)^γ · g(x_j) (g's output L2-normalised, as
    the authors' featprop), for one sample's locations x (N, C)."""
    values = [g.weight @ x_j + g.bias for x_j in x]
    values = [v / v.norm() for v in values]
    return torch.stack([sum(max(_cos(x_i, x_j), 0.0) ** gamma * values[j]
                            for j, x_j in enumerate(x)) for x_i in x])


def _reference_loss(x1: Tensor, x2: Tensor, t1: Tensor, t2: Tensor, g: torch.nn.Linear) -> float:
    """Eq. (4), as the authors' code scales it: per direction and sample, −2·cos(y_i, x'_j)
    averaged over the positive pairs (0 without one), averaged over the samples; summed over
    the two directions."""
    directions = [0.0, 0.0]
    for b, (box_1, box_2) in enumerate(zip(BOXES_1, BOXES_2, strict=True)):
        positives = _reference_positives(box_1, box_2)
        y1, y2 = _reference_propagation(x1[b], g), _reference_propagation(x2[b], g)
        pairs = [(i, j) for i in range(GRID ** 2) for j in range(GRID ** 2) if positives[i][j]]
        if pairs:
            directions[0] += sum(-2 * _cos(y1[i], t2[b, j]) for i, j in pairs) / len(pairs)
            directions[1] += sum(-2 * _cos(y2[j], t1[b, i]) for i, j in pairs) / len(pairs)
    return sum(directions) / len(BOXES_1)


def _inputs() -> tuple[Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(len(BOXES_1), GRID ** 2, DIM, dtype=torch.float64)
                 for _ in range(4))


def _boxes() -> tuple[Tensor, Tensor]:
    return (torch.tensor(BOXES_1, dtype=torch.float64), torch.tensor(BOXES_2, dtype=torch.float64))


def _implementation(x1: Tensor, x2: Tensor, t1: Tensor, t2: Tensor,
                    propagation: PixelPropagation, pairs: Callable[..., Tensor] = position_pairs
                    ) -> Tensor:
    positives = pairs(*_boxes(), GRID, GRID, T)
    return PixProLoss().pixel(propagation(x1), propagation(x2), t1, t2, positives)


def _propagation() -> PixelPropagation:
    torch.manual_seed(1)
    return PixelPropagation(DIM).double()


def test_positive_pairs_follow_the_original_image() -> None:
    expected = torch.tensor([_reference_positives(a, b) for a, b in zip(BOXES_1, BOXES_2,
                                                                        strict=True)])
    found = position_pairs(*_boxes(), GRID, GRID, T)
    assert torch.equal(found, expected)
    assert found[0].any() and found[2].any() and not found[3].any()
    assert not torch.equal(found, torch.eye(GRID ** 2, dtype=torch.bool).expand_as(found))


def test_loss_equals_the_papers_equations_in_float64() -> None:
    x1, x2, t1, t2 = _inputs()
    propagation = _propagation()
    g = propagation.transform[0]
    expected = _reference_loss(x1, x2, t1, t2, g)
    assert _implementation(x1, x2, t1, t2, propagation).item() == pytest.approx(expected, abs=1e-12)


def test_known_bad_variants_fail_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pairs by grid index instead of by position in the image, and the similarity without
    max(·, 0): each gives another value than the paper's equations."""
    x1, x2, t1, t2 = _inputs()
    propagation = _propagation()
    expected = _reference_loss(x1, x2, t1, t2, propagation.transform[0])

    def by_grid_index(boxes_a: Tensor, *_: object) -> Tensor:
        return torch.eye(GRID ** 2, dtype=torch.bool).expand(len(boxes_a), -1, -1)

    grid_index = _implementation(x1, x2, t1, t2, propagation, by_grid_index).item()
    assert abs(grid_index - expected) > 1e-3

    def unclamped(locations: Tensor) -> Tensor:
        x = torch.nn.functional.normalize(locations, dim=2)
        return (x @ x.transpose(1, 2)).pow(3)  # odd power: negative similarities stay negative

    monkeypatch.setattr(propagation, "similarity", unclamped)
    assert abs(_implementation(x1, x2, t1, t2, propagation).item() - expected) > 1e-3


def test_a_mirrored_view_pairs_the_mirrored_locations() -> None:
    box_a, box_b = torch.tensor([[2.0, 3, 24, 24, 0]]), torch.tensor([[4.0, 1, 22, 26, 0]])
    plain = position_pairs(box_a, box_b, GRID, GRID, T)[0].reshape(GRID ** 2, GRID, GRID)
    box_b[0, 4] = 1
    mirrored = position_pairs(box_a, box_b, GRID, GRID, T)[0].reshape(GRID ** 2, GRID, GRID)
    assert torch.equal(mirrored, plain.flip(-1)) and plain.any()


def test_instance_term_is_byols_loss_less_four() -> None:
    torch.manual_seed(2)
    p1, p2, z1, z2 = (torch.randn(3, DIM, dtype=torch.float64) for _ in range(4))
    expected = sum(-2 * _cos(p1[b], z2[b]) - 2 * _cos(p2[b], z1[b]) for b in range(3)) / 3
    assert PixProLoss(0.5).instance(p1, p2, z1, z2).item() == pytest.approx(expected, abs=1e-12)
    x1, x2, t1, t2 = _inputs()
    positives = position_pairs(*_boxes(), GRID, GRID, T)
    with_instance = PixProLoss(0.5)(x1, x2, t1, t2, positives, (p1, p2, z1, z2))
    alone = PixProLoss()(x1, x2, t1, t2, positives)
    assert with_instance.item() == pytest.approx(alone.item() + 0.5 * expected, abs=1e-12)


def _small(**kwargs: object) -> PixPro:
    torch.manual_seed(0)
    return method_entry("pixpro").small(small_convnet(), **kwargs).double()


def test_the_method_reads_the_boxes_of_located_views() -> None:
    transform = LocatedViews(preset="cifar", crop_size=8)
    torch.manual_seed(3)
    samples = [transform(Image.new("RGB", (16, 16), (40 * i, 90, 160))) for i in range(3)]
    views = [torch.stack([s[k] for s in samples]).double() for k in range(4)]
    method = _small()
    outputs = method.forward_views(views)
    expected = position_pairs(views[2], views[3], 2, 2, T)
    assert torch.equal(outputs["positives"], expected)
    loss = method.loss_from_outputs(outputs)
    loss.backward()
    assert method.propagation.transform[0].weight.grad.abs().sum() > 0
    assert method.predictor[0].weight.grad.abs().sum() > 0


def test_micro_batches_with_boxes_give_the_whole_batch_gradient() -> None:
    g = torch.Generator().manual_seed(4)
    views = [torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    batch = views + [torch.tensor(BOXES_1, dtype=torch.float64),
                     torch.tensor(BOXES_2, dtype=torch.float64)]
    whole, micro = whole_and_micro_batch_gradients(
        lambda micro: _small(micro_batch_size=micro), batch)
    torch.testing.assert_close(whole, micro, rtol=0, atol=1e-12)


def test_a_batch_without_boxes_is_refused_with_one_line() -> None:
    views = [torch.randn(2, 3, 8, 8, dtype=torch.float64) for _ in range(2)]
    with pytest.raises(ValueError, match="LocatedViews"):
        _small(require_boxes=True).forward_views(views)
    with pytest.raises(ValueError, match="LocatedViews"):
        _small().forward_views(views * 2)  # a third view that is not a box


def test_the_teacher_follows_the_instance_branch_only_when_it_is_on() -> None:
    assert len(_small().ema_pairs()) == 3
    off = _small(instance_weight=0.0)
    assert len(off.ema_pairs()) == 2 and not hasattr(off, "predictor")


@pytest.mark.parametrize("kwargs", [{"threshold": 0.0}, {"instance_weight": -1.0},
                                    {"gamma": 0.0}, {"transform_layers": 3}])
def test_bad_arguments_name_the_value(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PixPro(small_convnet(), projection_hidden_dim=8, projection_dim=4, **kwargs)
