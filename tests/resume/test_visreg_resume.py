"""Exact resume of VISReg: stopped inside epoch 0 and inside epoch 1 and resumed, a run of its
registered small instance (real image-folder data, random multi-crop augmentations, the shape
term's directions drawn from each step's shared seed) ends bit-identical to the uninterrupted
run: weights, optimiser, schedules, probe (``tests/resume_harness.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from test_resume_exact import RESUME_POINTS, _assert_identical, straight_and_resumed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    return straight_and_resumed(tmp_path_factory.mktemp("visreg_resume"), make_image_folder,
                                ["visreg"], {"visreg": "visreg"})


def test_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any) -> None:
    straight = runs("visreg")
    for step in RESUME_POINTS:
        _assert_identical(runs(f"visreg_from{step}"), straight)
