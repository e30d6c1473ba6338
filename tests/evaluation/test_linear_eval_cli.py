"""configs/linear.yaml through the real CLI: the checkpoint errors reach the user.

(The config itself runs in tests/product/test_configs.py with a real SimCLR checkpoint; fine-tuning
is covered by tests/evaluation/test_linear_eval.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ssl_lightning.backbones import SmallConvNet

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "linear.yaml"


def fake_checkpoint(backbone: torch.nn.Module, path: Path) -> str:
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in backbone.state_dict().items()}},
               path)
    return str(path)


def test_cli_names_the_mismatch_for_a_checkpoint_of_another_backbone(run_config, tmp_path,
                                                                      capsys):
    # The CLI prints a constructor's error as its own message (ssl_lightning/cli/errors.py)
    path = fake_checkpoint(SmallConvNet((64, 64)), tmp_path / "small.ckpt")
    with pytest.raises(SystemExit):  # a checkpoint without backbone_spec and no backbone given
        run_config(CONFIG, ["--model.checkpoint", path])
    assert "does not record its backbone class" in capsys.readouterr().err
    resnet = ["--model.backbone", "ssl_lightning.ResNet", "--model.backbone.depth", "18",
              "--model.backbone.cifar_stem", "true"]
    with pytest.raises(SystemExit) as exit_info:
        run_config(CONFIG, ["--model.checkpoint", path, *resnet])
    assert exit_info.value.code == 1
    assert "does not match the configured backbone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_config(CONFIG, ["--model.checkpoint", str(tmp_path / "nowhere.ckpt")])
    assert re.search("error: FileNotFoundError: Checkpoint file not found.*nowhere",
                     capsys.readouterr().err)

