"""Where two training states differ, and by how much: the messages of the checks in
:mod:`ssl_lightning.testing.checks`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ssl_lightning.testing.trainer_runs import queue_contents


def relative_difference(actual: Tensor, expected: Tensor) -> float:
    """``‖a − e‖ / ‖e‖`` in float64 (``‖a − e‖`` when ``e`` is zero); inf for other shapes."""
    if actual.shape != expected.shape:
        return float("inf")
    norm = float(torch.linalg.vector_norm(expected.double())) or 1.0
    return float(torch.linalg.vector_norm(actual.double() - expected.double())) / norm


def state_differences(actual: Any, expected: Any, tolerance: float, path: str = "",
                      queues_as_contents: bool = True) -> dict[str, float]:
    """Every entry of two nested states (tensors, dicts, lists, numbers) that differs by more
    than ``tolerance`` (relative, floating point; integer tensors and other values must be
    equal) -> its difference (inf: different shapes, keys or values). With
    ``queues_as_contents``, queues (names ending in ``queue``) are compared as contents and
    their pointers (``ptr``, ``shuffle_step``) not at all: their slots follow the enqueue
    order, which DDP changes."""
    if isinstance(expected, Tensor):
        if not isinstance(actual, Tensor):
            return {path: float("inf")}
        reorderable = queues_as_contents and path.endswith("queue")
        if reorderable:
            actual, expected = queue_contents(actual), queue_contents(expected)
        if expected.is_floating_point():
            difference = relative_difference(actual, expected)
            # NaN: a state that is not a number is never equal
            return {path: difference} if not difference <= tolerance else {}
        skipped = queues_as_contents and path.endswith(("ptr", "shuffle_step"))
        if skipped or torch.equal(actual, expected):
            return {}
        return {path: float("inf")}
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return {path: float("inf")}
        problems = {f"{path}.{k}".lstrip("."): float("inf") for k in set(actual) ^ set(expected)}
        for key in set(actual) & set(expected):
            problems.update(state_differences(actual[key], expected[key], tolerance,
                                              f"{path}.{key}".lstrip("."), queues_as_contents))
        return problems
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return {path: float("inf")}
        problems = {}
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            problems.update(state_differences(a, e, tolerance, f"{path}[{i}]", queues_as_contents))
        return problems
    return {} if actual == expected else {path: float("inf")}


def describe(problems: dict[str, float], tolerance: float, limit: int = 5) -> str:
    """The largest differences, one per line: ``name: 3.2e-03 (relative, tolerance 1e-10)``."""
    worst = sorted(problems.items(), key=lambda item: -item[1])
    lines = [f"  {name}: {difference:.3g} (relative; tolerance {tolerance:g})"
             for name, difference in worst[:limit]]
    if len(worst) > limit:
        lines.append(f"  ... and {len(worst) - limit} more")
    return "\n".join(lines)
