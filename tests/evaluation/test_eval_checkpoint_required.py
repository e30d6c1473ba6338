"""LinearEval and KNNEval refuse a random backbone unless asked (``checkpoint: random``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.evaluation import KNNEval, LinearEval

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("make", [lambda **kw: LinearEval(SmallConvNet((8,)), 3, **kw),
                                  lambda **kw: KNNEval(SmallConvNet((8,)), **kw)],
                         ids=["LinearEval", "KNNEval"])
def test_missing_checkpoint_is_refused_and_random_is_explicit(make) -> None:
    for missing in ({}, {"checkpoint": None}, {"checkpoint": ""}):
        with pytest.raises(ValueError, match=r"no checkpoint.*randomly initialised.*"
                                             r"--model\.checkpoint.*checkpoint: random"):
            make(**missing)
    torch.manual_seed(0)
    expected = SmallConvNet((8,)).state_dict()
    torch.manual_seed(0)
    model = make(checkpoint="random")  # the random-init baseline, as constructed
    for key, value in expected.items():
        assert torch.equal(model.backbone.state_dict()[key], value), key


def test_linear_config_without_checkpoint_fails_through_the_cli(run_config, capsys) -> None:
    with pytest.raises(SystemExit):
        run_config(ROOT / "configs" / "linear.yaml")
    err = capsys.readouterr().err
    assert "LinearEval got no checkpoint" in err and "checkpoint: random" in err
