"""Exact resume of MSN and PMSN: stopped inside epoch 0 and inside epoch 1 and resumed, a run
with the real image-folder data module, random multi-crop augmentations, keyed token dropping,
stochastic depth and a BatchNorm head ends bit-identical to the uninterrupted run (weights,
prototypes, EMA teachers, optimiser, schedules, probe; ``tests/resume_harness.py``).

Known-bad: a resume that rebuilds the EMA teacher from the student (a teacher kept outside the
checkpoint) ends elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
from momentum_utils import fit_and_resume, views_loader
from test_resume_exact import RESUME_POINTS, _assert_identical, straight_and_resumed

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import MSN

pytestmark = pytest.mark.slow

METHODS = ["msn", "pmsn"]


def make_runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> Any:  # type: ignore[no-untyped-def]
    return straight_and_resumed(tmp_path_factory.mktemp("msn_resume"), make_image_folder,
                                METHODS, {m: m for m in METHODS})


@pytest.mark.parametrize("method", METHODS)
def test_resume_inside_epoch_0_and_1_is_bit_identical(runs: Any, method: str) -> None:
    straight = runs(method)
    assert (straight["model"]["prototypes.layer.weight"] != 0).all()
    for step in RESUME_POINTS:
        _assert_identical(runs(f"{method}_from{step}"), straight)


class _TeacherFromStudentMSN(MSN):
    """Known-bad: on resume the teacher is a fresh copy of the student."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith("teacher_")]:
            state[key] = state[key.removeprefix("teacher_")].clone()
        super().on_load_checkpoint(checkpoint)


def _small_msn(cls: type[MSN] = MSN) -> pl.LightningModule:
    return cls(ViT(image_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2),
               projection_hidden_dim=8, projection_dim=4, num_prototypes=6, mask_ratio=0.25,
               head_batch_norm=False, image_size=8, optimizer="sgd", lr=0.3, lr_scaling="none",
               warmup_epochs=0.5)


def test_a_teacher_rebuilt_from_the_student_does_not_resume(tmp_path) -> None:  # type: ignore[no-untyped-def]
    good, good_resumed = fit_and_resume(
        _small_msn, lambda: views_loader(n=8, batch_size=4, num_views=3, size=8),
        str(tmp_path / "good"))
    assert all((good_resumed[k] == v).all() for k, v in good.items())
    full, resumed = fit_and_resume(
        lambda: _small_msn(_TeacherFromStudentMSN),
        lambda: views_loader(n=8, batch_size=4, num_views=3, size=8), str(tmp_path / "bad"))
    assert any(not (resumed[k] == v).all() for k, v in full.items() if k.startswith("teacher_"))
