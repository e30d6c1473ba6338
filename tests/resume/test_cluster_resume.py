"""Exact resume of DeepCluster v2 and SMoG: stopped inside epoch 0 and inside epoch 1 and resumed,
a run
with the real image-folder data module and random multi-crop augmentations ends bit-identical to
the uninterrupted run (weights, prototypes, the dataset bank, the epoch's k-means assignments;
SMoG's groups, bank and teacher; optimiser, schedules, probe; ``tests/resume_harness.py``).

Known-bad: assignments kept outside the checkpoint (a plain attribute) end elsewhere after a
resume inside an epoch (Lightning does not call ``on_train_epoch_start`` again there).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_resume_exact import RESUME_POINTS, _assert_identical, _run_jobs

METHODS = ["deepcluster_v2", "deepcluster_v2_unsaved", "smog"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("cluster_resume")
    data = root / "data"
    make_image_folder(data / "train", classes=2, per_class=12, seed=0)
    make_image_folder(data / "test", classes=2, per_class=6, seed=1)

    def job(name: str, method: str, workers: int, **extra: Any) -> dict[str, Any]:
        return {"method": method, "data_root": str(data), "workers": workers, "epochs": 2,
                "out": str(root / f"{name}.pt"), **extra}

    ckpts = {m: str(root / f"ckpt_{m.replace('_unsaved', '')}") for m in METHODS}
    _run_jobs([job(m, m, 0, ckpt_dir=ckpts[m]) for m in ("deepcluster_v2", "smog")],
              root / "straight.json")
    _run_jobs([job(f"{m}_from{step}", m, workers, resume=f"{ckpts[m]}/step={step}.ckpt")
               for m in METHODS for step, workers in RESUME_POINTS.items()],
              root / "resumes.json")
    return lambda name: torch.load(root / f"{name}.pt", weights_only=True)


def test_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any) -> None:
    straight = runs("deepcluster_v2")
    assert int(straight["model"]["clustered_epoch"]) == 1
    assert len(set(straight["model"]["assignments"][0].tolist())) > 1
    for step in RESUME_POINTS:
        _assert_identical(runs(f"deepcluster_v2_from{step}"), straight)


def test_assignments_outside_the_checkpoint_are_caught(runs: Any) -> None:
    straight = runs("deepcluster_v2")
    resumed = runs("deepcluster_v2_unsaved_from9")  # inside epoch 1
    moved = [k for k, v in straight["model"].items()
             if not torch.equal(resumed["model"][k], v)]
    assert "prototypes.0.layer.weight" in moved, moved


def test_smog_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any) -> None:
    straight = runs("smog")
    for step in RESUME_POINTS:
        _assert_identical(runs(f"smog_from{step}"), straight)
