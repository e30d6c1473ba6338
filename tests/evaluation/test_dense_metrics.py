"""Dense-probe metrics against float64 references written here from their definitions
(ssl_lightning/evaluation/dense/metrics.py), sliding-window inference, and the confusion
matrix of 2 processes = 1 process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from distributed_utils import run_in_processes
from torchmetrics.classification import MulticlassJaccardIndex

from ssl_lightning.evaluation.dense.frozen import sliding_window, window_starts
from ssl_lightning.evaluation.dense.metrics import (
    ConfusionMatrix,
    depth_image_errors,
    depth_scores,
    segmentation_scores,
    sig_loss,
)

IGNORE = 255


def _labels(seed: int, shape: tuple[int, ...], classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(classes, shape, generator=g)
    target[torch.rand(shape, generator=g) < 0.1] = IGNORE
    pred = torch.where(torch.rand(shape, generator=g) < 0.6, target.clamp(max=classes - 1),
                       torch.randint(classes, shape, generator=g))
    return pred, target


def _miou_reference(pred: np.ndarray, target: np.ndarray, classes: int) -> tuple[float, float]:
    """mIoU over classes (those with a non-empty union) and pixel accuracy, by loops."""
    ious = []
    for c in range(classes):
        inter = union = 0
        for p, t in zip(pred.ravel().tolist(), target.ravel().tolist(), strict=True):
            if t == IGNORE:
                continue
            inter += p == c and t == c
            union += p == c or t == c
        if union:
            ious.append(inter / union)
    valid = target != IGNORE
    return 100 * sum(ious) / len(ious), 100 * float((pred[valid] == target[valid]).mean())


def test_miou_equals_the_definition_and_torchmetrics() -> None:
    pred, target = _labels(0, (3, 17, 19), 5)
    matrix = ConfusionMatrix(5, IGNORE)
    for p, t in zip(pred, target, strict=True):  # accumulated over batches
        matrix.update(p[None], t[None])
    scores = matrix.compute()
    miou, acc = _miou_reference(pred.numpy(), target.numpy(), 5)
    assert math.isclose(float(scores["miou"]), miou, rel_tol=0, abs_tol=1e-10)
    assert math.isclose(float(scores["pixel_acc"]), acc, rel_tol=0, abs_tol=1e-10)
    jaccard = MulticlassJaccardIndex(5, average="macro", ignore_index=IGNORE)
    assert math.isclose(float(scores["miou"]), 100 * float(jaccard(pred, target)),
                        abs_tol=1e-4)


def test_miou_is_a_mean_over_classes_not_pixels() -> None:
    """Known-bad: IoU pooled over pixels (a frequency-weighted mean) is not mIoU; with one
    large class right and a small class wrong they differ, and the metric is the former."""
    target = torch.zeros(100, dtype=torch.long)
    target[:5] = 1
    pred = torch.zeros(100, dtype=torch.long)
    matrix = ConfusionMatrix(2, IGNORE)
    matrix.update(pred, target)
    scores = matrix.compute()
    assert math.isclose(float(scores["miou"]), 100 * (95 / 100 + 0) / 2, abs_tol=1e-10)
    counts = matrix.counts
    per_pixel = 100 * counts.diagonal().sum() / (2 * counts.sum() - counts.diagonal().sum())
    assert abs(float(per_pixel) - float(scores["miou"])) > 40


def test_a_class_absent_from_targets_and_predictions_has_no_iou() -> None:
    scores = segmentation_scores(torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 0.0],
                                               [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert math.isnan(float(scores["iou"][2]))
    assert math.isclose(float(scores["miou"]), 100 * (3 / 4 + 2 / 3) / 2, abs_tol=1e-10)


def test_depth_metrics_equal_their_formulas() -> None:
    g = torch.Generator().manual_seed(1)
    target = torch.rand(3, 6, 7, generator=g, dtype=torch.float64) * 9
    target[0, :2] = 0  # no depth
    target[2] = 0  # an image without a valid pixel is not counted
    pred = target + torch.randn(3, 6, 7, generator=g, dtype=torch.float64) * 0.5
    scores = depth_scores(depth_image_errors(pred, target, 1e-3, 10.0).sum(dim=0))
    rmse, rel, d1 = [], [], []
    for p, t in zip(pred[:2].numpy(), target[:2].numpy(), strict=True):
        valid = (t > 1e-3) & (t <= 10)
        p, t = np.maximum(p[valid], 1e-3), t[valid]
        rmse.append(np.sqrt(np.mean((p - t) ** 2)))
        rel.append(np.mean(np.abs(p - t) / t))
        d1.append(np.mean(np.maximum(p / t, t / p) < 1.25))
    for key, values in (("rmse", rmse), ("abs_rel", rel), ("delta1", d1)):
        assert math.isclose(float(scores[key]), float(np.mean(values)), abs_tol=1e-12), key


def test_sig_loss_equals_its_formula() -> None:
    g = torch.Generator().manual_seed(2)
    target = torch.rand(2, 5, 5, generator=g, dtype=torch.float64) * 5
    pred = torch.rand(2, 5, 5, generator=g, dtype=torch.float64) * 5
    valid = target > 1
    d = np.log(pred.numpy()[valid.numpy()] + 1e-3) - np.log(target.numpy()[valid.numpy()] + 1e-3)
    n = d.size
    variance = np.sum((d - d.mean()) ** 2) / (n - 1)
    expected = np.sqrt(variance + 0.15 * d.mean() ** 2)
    assert math.isclose(float(sig_loss(pred, target, valid)), float(expected), abs_tol=1e-12)
    assert float(sig_loss(2 * target, target, valid)) > 0  # a wrong scale costs (λ < 1)


def test_sliding_windows_cover_the_image_and_average_overlaps() -> None:
    assert window_starts(10, 4, 3) == [0, 3, 6]
    assert window_starts(11, 4, 3) == [0, 3, 6, 7]
    assert window_starts(4, 8, 3) == [0]
    image = torch.randn(2, 3, 11, 13, dtype=torch.float64)
    pointwise = sliding_window(lambda x: x.sum(dim=1, keepdim=True), image, 4, 3)
    torch.testing.assert_close(pointwise, image.sum(dim=1, keepdim=True), rtol=0, atol=1e-12)


def _confusion_ranks(rank: int, world: int) -> torch.Tensor:
    pred, target = _labels(3, (6, 9, 9), 4)
    matrix = ConfusionMatrix(4, IGNORE)
    for i in range(rank, 6, world):  # DistributedSampler's split
        matrix.update(pred[i], target[i])
    scores = matrix.compute()
    return torch.cat([scores["miou"][None], scores["pixel_acc"][None], scores["iou"]])


@pytest.mark.slow
def test_two_processes_give_the_scores_of_one() -> None:
    one = _confusion_ranks(0, 1)
    for result in run_in_processes(_confusion_ranks, 2):
        torch.testing.assert_close(result, one, rtol=0, atol=1e-12)


def test_the_padding_duplicates_of_the_last_val_batch_are_left_out() -> None:
    """5 val images on 2 ranks: DistributedSampler gives rank 1 the images 1, 3 and a copy of
    image 0, which must not be scored twice."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler

    from ssl_lightning.evaluation.dense.frozen import real_samples

    data = list(range(5))
    keeps = []
    for rank in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
        trainer = SimpleNamespace(val_dataloaders=[DataLoader(data, sampler=sampler)])
        keeps.append(torch.cat([real_samples(trainer, 0, start, 1, torch.device("cpu"))
                                for start in range(3)]).tolist())
    assert keeps == [[True, True, True], [True, True, False]]
