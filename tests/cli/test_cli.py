"""The LightningCLI entry point: --help, --print_config, main(args=[...]), overrides, swapping
the backbone, and ``python -m ssl_lightning``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from pytorch_lightning.callbacks import LearningRateMonitor, ProgressBar

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]

TINY_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger:
    class_path: pytorch_lightning.loggers.TensorBoardLogger
    init_args: {save_dir: runs, name: tiny}
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {save_last: true}
  enable_progress_bar: false
  enable_model_summary: false
model:
  class_path: SimCLR
  init_args:
    backbone:
      class_path: SmallConvNet
      init_args: {widths: [8, 16]}
    projection_hidden_dim: 16
    projection_dim: 8
    head_batch_norm: false
    optimizer: sgd
    lr: 0.1
    lr_scaling: none
    warmup_epochs: 0
data:
  class_path: CIFAR10DataModule
  init_args: {batch_size: 4, num_workers: 0}
"""


@pytest.fixture
def tiny_config(tmp_path: Path, tiny_image_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tiny.yaml"
    config = yaml.safe_load(TINY_CONFIG)
    config["data"]["init_args"]["root"] = str(tiny_image_folder)
    path.write_text(yaml.safe_dump(config))
    return path


def test_help_lists_subcommands_and_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("fit", "validate", "test"))
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--model" in out and "--data" in out and "--trainer.devices" in out


def test_print_config_resolves_short_class_names(tiny_config: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tiny_config), "--model.temperature", "0.3",
              "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert model["class_path"] == "ssl_lightning.SimCLR"
    assert model["init_args"]["temperature"] == 0.3  # the override
    assert model["init_args"]["backbone"]["class_path"] == "ssl_lightning.SmallConvNet"
    assert model["init_args"]["weight_decay"] == 1e-6  # a base-class (**kwargs) default
    data = printed["data"]["init_args"]
    assert printed["data"]["class_path"] == "ssl_lightning.CIFAR10DataModule"
    assert data["batch_size"] == 4 and data["drop_last"] is True  # a base-class default


def test_main_fit_trains_and_writes_checkpoint(tiny_config: Path, tmp_path: Path) -> None:
    cli = main(["fit", "--config", str(tiny_config), "--model.temperature", "0.3"])
    assert isinstance(cli.model, SimCLR) and isinstance(cli.model.backbone, SmallConvNet)
    assert cli.model.hparams.temperature == 0.3 and cli.model.criterion.temperature == 0.3
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    version = tmp_path / "runs" / "tiny" / "version_0"
    assert (version / "checkpoints" / "last.ckpt").is_file()
    assert yaml.safe_load((version / "config.yaml").read_text())["model"]["init_args"][
        "temperature"] == 0.3  # the run's full config is saved beside the logs


def test_main_without_run_builds_the_simclr_config(tiny_image_folder: Path) -> None:
    cli = main(["--config", str(ROOT / "configs" / "simclr.yaml"),
                "--data.root", str(tiny_image_folder)], run=False)
    assert isinstance(cli.model, SimCLR) and cli.model.feature_dim == 512  # ResNet-18
    assert cli.model.backbone.net.conv1.stride == (1, 1)  # CIFAR stem
    assert type(cli.datamodule).__name__ == "CIFAR10DataModule"
    names = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"ModelCheckpoint", "LearningRateMonitor", "KNNCallback", "OnlineProbe"} <= names


def test_backbone_swapped_for_a_torchvision_model(tiny_config: Path) -> None:
    cli = main(["fit", "--config", str(tiny_config),
                "--model.backbone", "torchvision.models.resnet18",
                "--model.backbone.init_args.num_classes", "64", "--trainer.max_steps", "1",
                "--trainer.limit_val_batches", "0"])
    assert type(cli.model.backbone).__module__ == "torchvision.models.resnet"
    assert cli.model.feature_dim == 64 and cli.trainer.global_step == 1


def test_bad_value_is_reported_by_the_parser(tiny_config: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tiny_config), "--model.optimizer", "adam"])
    assert exit_info.value.code != 0
    assert "adam" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_entry_point() -> None:
    result = subprocess.run([sys.executable, "-m", "ssl_lightning", "fit", "--help"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout


@pytest.mark.parametrize(("value", "batches"), [("1", 1), ("0.5", 3)])
@pytest.mark.parametrize("source", ["command line", "yaml"])
def test_limit_train_batches_int_counts_batches_float_is_a_fraction(
        tiny_config: Path, tmp_path: Path, value: str, batches: int, source: str) -> None:
    """24 images in batches of 4: 6 batches an epoch; ``1`` is one batch, ``0.5`` half."""
    if source == "yaml":
        extra = tmp_path / "limit.yaml"
        extra.write_text(f"trainer: {{limit_train_batches: {value}}}\n")
        args = ["--config", str(extra)]
    else:
        args = ["--trainer.limit_train_batches", value]
    cli = main(["fit", "--config", str(tiny_config), *args, "--trainer.max_steps", "-1",
                "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0"])
    assert cli.trainer.num_training_batches == batches
    assert cli.trainer.global_step == batches


def test_every_batch_count_argument_keeps_an_integer_an_int(tiny_config: Path) -> None:
    from ssl_lightning.cli.app import BATCH_COUNT_ARGUMENTS

    args = [arg for name in BATCH_COUNT_ARGUMENTS for arg in (f"--trainer.{name}", "1")]
    cli = main(["--config", str(tiny_config), *args], run=False)
    for name in BATCH_COUNT_ARGUMENTS:
        assert type(cli.config.trainer[name]) is int, name
    cli = main(["--config", str(tiny_config), "--trainer.limit_val_batches", "1.0"], run=False)
    assert type(cli.config.trainer.limit_val_batches) is float


def test_fit_without_logger_drops_the_lr_monitor(tiny_config: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        cli = main(["fit", "--config", str(tiny_config), "--trainer.logger", "false",
                    "--trainer.callbacks+=LearningRateMonitor", "--trainer.max_steps", "1",
                    "--trainer.limit_val_batches", "0"])
    assert cli.trainer.global_step == 1
    assert not any(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks)
    notes = [r.getMessage() for r in caplog.records if "LearningRateMonitor" in r.getMessage()]
    assert len(notes) == 1 and "dropped" in notes[0]


def test_no_progress_bar_drops_the_configs_progress_bar(tiny_config: Path) -> None:
    """Every shipped config names a TQDMProgressBar; ``--trainer.enable_progress_bar false``
    drops it instead of Lightning's MisconfigurationException."""
    cli = main(["--config", str(tiny_config), "--trainer.callbacks+=TQDMProgressBar",
                "--trainer.enable_progress_bar", "false"], run=False)
    assert not any(isinstance(c, ProgressBar) for c in cli.trainer.callbacks)
