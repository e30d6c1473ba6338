"""Known-bad for the exact-resume property (``tests/properties/test_exact_resume.py``, which
resumes every registered method, TiCo's running covariance included, inside an epoch): TiCo
with its running covariance kept out of the checkpoint, as lightly's plain attribute does,
resumes with C = 0, and :func:`ssl_lightning.testing.assert_resume_is_exact` names what
differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssl_lightning.losses import TiCoLoss
from ssl_lightning.methods import TiCo
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import PrecomputedViews, ViewsDataModule, assert_resume_is_exact

#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


class _UnsavedCovarianceTiCo(TiCo):
    """Known-bad: the running covariance is not in the checkpoint."""

    def build_criterion(self) -> TiCoLoss:
        criterion = super().build_criterion()
        criterion._non_persistent_buffers_set.add("covariance")
        return criterion


def test_tico_without_its_covariance_in_the_checkpoint_does_not_resume(tmp_path: Path) -> None:
    entry = method_entry("tico")
    bad = lambda: _UnsavedCovarianceTiCo(  # noqa: E731  (the registered instance's settings)
        **{**entry.small().hparams, "backbone": entry.backbone()})
    with pytest.raises(AssertionError, match=r"resumed after step 1 of 4 \(epoch 0\):\n  "):
        assert_resume_is_exact(bad, ViewsDataModule(PrecomputedViews(8, entry.views), 4),
                               str(tmp_path), stop_steps=(1,))
