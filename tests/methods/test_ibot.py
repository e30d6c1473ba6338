"""iBOT (Zhou et al., ICLR 2022) and iBOT++ (its visible-patch term): iBOT++ trained on 2
processes equals one process fed the global batch in the sampler's order (the registry's
property checks iBOT itself, ``tests/properties/test_ddp_equals_one_process.py``)."""

from __future__ import annotations

import pytest

from ssl_lightning.methods import IBOT
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import KeyedViews, assert_two_processes_equal_one

OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)


def _ibot_plus_plus() -> IBOT:
    return method_entry("ibot").small(patch_visible_weight=0.5, **OPTIM)


@pytest.mark.slow
def test_ibot_plus_plus_on_two_processes_equals_one_process() -> None:
    assert_two_processes_equal_one(_ibot_plus_plus, KeyedViews(24, method_entry("ibot").views))
