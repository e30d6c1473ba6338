"""``Method.load_from_checkpoint(path)`` with no arguments, for checkpoints the CLI writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssl_lightning.methods import DINO, SimCLR

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("config, method", [("simclr.yaml", SimCLR), ("dino.yaml", DINO)],
                         ids=["simclr", "dino-momentum-teacher"])
def test_load_from_checkpoint_needs_no_arguments(run_config, config, method):
    cli = run_config(CONFIGS / config)
    path = str(Path(cli.trainer.default_root_dir) / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    loaded = method.load_from_checkpoint(path)
    assert type(loaded) is method
    trained = cli.model.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    for key, value in loaded.state_dict().items():  # backbone, heads and teacher alike
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
