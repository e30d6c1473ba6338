"""Exact resume of the dense methods: stopped inside epoch 0 and inside epoch 1 and resumed, a
run with the real image-folder data module and random augmentations ends bit-identical to the
uninterrupted run (weights, teachers, DenseCL's global and dense queues, VICRegL's heads,
optimiser, schedules, probe; ``tests/resume_harness.py`` runs the registered small instances by
name)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_resume_exact import RESUME_POINTS, _assert_identical, straight_and_resumed

pytestmark = pytest.mark.slow

METHODS = ["densecl", "vicregl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    return straight_and_resumed(tmp_path_factory.mktemp("dense_resume"), make_image_folder,
                                METHODS, {m: m for m in METHODS})


def test_densecl_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any) -> None:
    straight = runs("densecl")
    initial = torch.nn.functional.normalize(  # FeatureQueue(seed=1)'s initial rows
        torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), dim=1)
    assert not torch.equal(straight["model"]["dense_queue.queue"].float(), initial)
    for step in RESUME_POINTS:
        _assert_identical(runs(f"densecl_from{step}"), straight)


def test_vicregl_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any) -> None:
    straight = runs("vicregl")
    for step in RESUME_POINTS:
        _assert_identical(runs(f"vicregl_from{step}"), straight)
