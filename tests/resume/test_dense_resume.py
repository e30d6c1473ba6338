"""Exact resume of VICRegL with position matching on located views: stopped inside epoch 0 and
inside epoch 1 and resumed, a run with the real image-folder data module and random
``LocatedViews`` ends bit-identical to the uninterrupted run (weights, heads, optimiser,
schedules, probe; ``tests/resume_harness.py``). DenseCL's registered instance, with its global
and dense queues, is resumed by the exact-resume property (``tests/properties/``)."""

from __future__ import annotations

from typing import Any

import pytest
from test_resume_exact import RESUME_POINTS, _assert_identical, straight_and_resumed

pytestmark = pytest.mark.slow

METHODS = ["vicregl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    return straight_and_resumed(tmp_path_factory.mktemp("dense_resume"), make_image_folder,
                                METHODS, {m: m for m in METHODS})


def test_vicregl_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any) -> None:
    straight = runs("vicregl")
    for step in RESUME_POINTS:
        _assert_identical(runs(f"vicregl_from{step}"), straight)
