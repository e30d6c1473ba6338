"""Exact resume of the DINO family's Matryoshka heads and PaKA term: stopped inside epoch 0 and
inside epoch 1 and resumed, a run of the registered presets (their small instances with the term
switched on, real image-folder data, random multi-crop augmentations, keyed block masks) ends
bit-identical to the uninterrupted run: weights, every level's head and prototypes, the PaKA
head and its EMA teacher, optimiser, schedules, probe (``tests/resume_harness.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from test_resume_exact import RESUME_POINTS, _assert_identical, straight_and_resumed

pytestmark = pytest.mark.slow

METHODS = ["dinov2_matryoshka", "dinov2_paka"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    return straight_and_resumed(tmp_path_factory.mktemp("dino_options_resume"),
                                make_image_folder, METHODS, {m: m for m in METHODS})


@pytest.mark.parametrize("method", METHODS)
def test_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any, method: str) -> None:
    straight = runs(method)
    term = {"dinov2_matryoshka": "head.heads.2.last_layer_v",
            "dinov2_paka": "teacher_paka_head.0.weight"}[method]
    assert term in straight["model"]
    for step in RESUME_POINTS:
        _assert_identical(runs(f"{method}_from{step}"), straight)
