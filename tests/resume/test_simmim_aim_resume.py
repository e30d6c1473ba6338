"""Exact mid-epoch resume of SimMIM and AIM with the real data module and random augmentations
(``tests/resume_harness.py``, in two fresh processes): a 2-epoch fit with a checkpoint after
every optimiser step, resumed from step 2 (inside epoch 0, 2 workers) and from step 9 (inside
epoch 1, 0 workers), ends bit-identical (model, optimiser, schedule, probe). The masks, prefixes
and drop-path decisions come from the samples' seeds, so the resumed run needs no RNG state.
Known-bad: AIM drawing its prefixes from a generator made at construction (not in the
checkpoint) resumes to other weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_resume_exact import RESUME_POINTS, straight_and_resumed

from ssl_lightning.testing.trainer_runs import assert_states_close

pytestmark = pytest.mark.slow

METHODS = ["simmim", "aim", "aim_init_stream"]


def make_runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    return straight_and_resumed(tmp_path_factory.mktemp("resume_simmim_aim"), make_image_folder,
                                METHODS, {m: m for m in METHODS})


@pytest.mark.parametrize("method", METHODS[:2])
def test_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any, method: str) -> None:
    straight = runs(method)
    assert straight["global_step"] == 12 and "val/knn_top1" in straight["metrics"]
    for step in RESUME_POINTS:
        resumed = runs(f"{method}_from{step}")
        assert resumed["global_step"] == 12
        for part in ("model", "optimizer", "scheduler", "callbacks"):
            assert_states_close(resumed[part], straight[part], atol=0.0, path=part)


def test_known_bad_prefix_stream_outside_the_checkpoint_does_not_resume(runs: Any) -> None:
    straight, resumed = runs("aim_init_stream"), runs("aim_init_stream_from9")
    assert any(not torch.equal(resumed["model"][k], v) for k, v in straight["model"].items())
