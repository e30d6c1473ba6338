"""Errors reach the user readably through ``ssl_lightning.cli.main``: a constructor's
``ValueError`` as its own message, an unknown ``class_path`` with the closest name and the
available ones, an unknown argument (command line or config) with the closest name and the
class's arguments, LightningCLI's automatic ``--optimizer`` refused, ``sync_batchnorm`` on CPU
processes refused before training, a backbone that is not an ``nn.Module`` instance named, and
a setting refused while the run sets up as one line (a bug keeps its traceback)."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest
import yaml
from torch._utils import ExceptionWrapper
from torch.multiprocessing.spawn import ProcessRaisedException

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.cli import main
from ssl_lightning.cli.errors import run_error_message
from ssl_lightning.data.datasets import CorruptImageError, check_directory
from ssl_lightning.training.divergence import TrainingDivergedError

CONFIG = """
trainer: {accelerator: cpu, devices: 1, max_steps: 1, logger: false}
model:
  class_path: SimCLR
  init_args:
    backbone: {class_path: SmallConvNet, init_args: {widths: [8, 16]}}
    projection_hidden_dim: 16
    projection_dim: 8
data:
  class_path: CIFAR10DataModule
  init_args: {batch_size: 4, num_workers: 0}
"""


@pytest.fixture
def fit(tmp_path: Path, tiny_image_folder: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(CONFIG)
    config["data"]["init_args"]["root"] = str(tiny_image_folder)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return lambda *args: main(["fit", "--config", str(path), *args])


def _stderr(capsys, fit, *args: str, code: int) -> str:
    with pytest.raises(SystemExit) as exit_info:
        fit(*args)
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Given value" not in err and "Subtypes" not in err, err
    assert len(err.splitlines()) <= 2, err
    return err


def test_constructor_value_error_is_printed_as_its_own_message(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.init_args.temperature", "-1", code=1)
    assert err.splitlines()[0] == "error: NTXentLoss temperature must be > 0, got -1.0."
    err = _stderr(capsys, fit, "--model.lr", "-1", code=1)
    assert err.splitlines()[0] == "error: lr must be > 0, got -1.0."


@pytest.mark.parametrize(("args", "suggestion", "listed"), [
    (["--model", "SimCRL"], "Did you mean 'SimCLR'?", "Available methods: AIM, "),
    (["--data", "CIFAR10DataModul"], "Did you mean 'CIFAR10DataModule'?",
     "Available data modules: CIFAR100DataModule, CIFAR10DataModule, ImageFolderDataModule"),
    (["--model.backbone", "SmallConvNett"], "Did you mean 'ssl_lightning.SmallConvNet'?",
     "Available backbones: ssl_lightning.ResNet, ssl_lightning.SmallConvNet"),
])
def test_unknown_class_path_suggests_the_closest_name(fit, capsys, args, suggestion,
                                                      listed) -> None:
    err = _stderr(capsys, fit, *args, code=2)
    assert f"unknown class {args[1]!r}" in err and suggestion in err and listed in err


@pytest.mark.parametrize(("args", "message", "listed"), [
    (["--model.temprature", "0.1"],
     "--model (SimCLR): unknown argument 'temprature'. Did you mean 'temperature'?",
     "Arguments of SimCLR: backbone, betas,"),
    (["--model.init_args.temprature=0.1"],
     "--model (SimCLR): unknown argument 'temprature'. Did you mean 'temperature'?",
     "projection_dim, projection_hidden_dim, projection_layers, projector, queue_size, rng_seed,"),
    (["--data.batchsize", "3"],
     "--data (CIFAR10DataModule): unknown argument 'batchsize'. Did you mean 'batch_size'?",
     "Arguments of CIFAR10DataModule: archive, archive_max_mb, batch_size, "),
    (["--trainer.max_epoch", "2"],
     "--trainer: unknown argument 'max_epoch'. Did you mean 'max_epochs'?",
     "Arguments of --trainer: accelerator, "),
    (["--model.backbone.widht", "3"],
     "--model.backbone (SmallConvNet): unknown argument 'widht'. Did you mean 'widths'?",
     "Arguments of SmallConvNet: in_chans, norm, pretrained_path, widths."),
    (["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitr", "x"],
     "--trainer.callbacks (ModelCheckpoint): unknown argument 'monitr'. Did you mean 'monitor'?",
     "Arguments of ModelCheckpoint: "),
    (["--seed_everythin", "3"],
     "unknown argument 'seed_everythin'. Did you mean 'seed_everything'?",
     "Arguments of fit: ckpt_path, config, data, model, print_config, resume_in_place, "
     "seed_everything, "),
])
def test_an_unknown_argument_suggests_the_closest_one(fit, capsys, args, message,
                                                      listed) -> None:
    err = _stderr(capsys, fit, *args, code=2)
    assert err.startswith(f"error: {message} "), err
    assert listed in err.splitlines()[0]
    # a command that runs as written (it said "__main__.py fit --help" under python -m)
    assert err.splitlines()[1] == "(all options: python -m ssl_lightning fit --help)"


def test_an_unknown_argument_lists_no_deprecated_name(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.init_args.memory_bank_siz=8", code=2)
    assert err.startswith("error: --model (SimCLR): unknown argument 'memory_bank_siz'. "
                          "Arguments of SimCLR: backbone, "), err
    assert "memory_bank_size" not in err and "projection_batch_norm" not in err


@pytest.mark.parametrize(("section", "key", "message"), [
    ("model", "projection_dm",
     "--model (SimCLR): unknown argument 'projection_dm'. Did you mean 'projection_dim'?"),
    ("data", "batchsize",
     "--data (CIFAR10DataModule): unknown argument 'batchsize'. Did you mean 'batch_size'?"),
    ("trainer", "max_step", "--trainer: unknown argument 'max_step'. Did you mean 'max_steps'?"),
])
def test_an_unknown_key_of_a_config_suggests_the_closest_one(fit, capsys, tmp_path: Path,
                                                             section, key, message) -> None:
    config = yaml.safe_load((tmp_path / "tiny.yaml").read_text())
    part = config[section]
    (part.get("init_args", part))[key] = 4
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(config))
    err = _stderr(capsys, lambda *a: main(["fit", "--config", str(typo)]), code=2)
    assert err.startswith(f"error: {message} "), err


def test_parser_errors_name_the_option_without_union_noise(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.optimizer", "adam", code=2)
    assert err.startswith("error: --model.optimizer: Expected a typing.Literal['lars', 'sgd', "
                          "'adamw']. Got value: adam")


def test_sync_batchnorm_on_cpu_processes_is_refused_before_training(fit, capsys) -> None:
    err = _stderr(capsys, fit, "--model.head_batch_norm", "true", "--trainer.devices", "2",
                  "--trainer.strategy", "ddp_spawn", "--trainer.sync_batchnorm", "true", code=1)
    assert "SyncBatchNorm does not run on CPU" in err
    assert "Pass --trainer.sync_batchnorm false" in err


@pytest.mark.parametrize(("backbone", "got"), [
    (None, "got None (NoneType)"), (SmallConvNet, "got the class SmallConvNet itself")])
def test_backbone_must_be_a_module_instance(backbone, got) -> None:
    message = f"backbone must be an nn.Module instance, {got}"
    with pytest.raises(TypeError, match=re.escape(message)):
        SimCLR(backbone)


def test_a_trainer_misconfiguration_is_printed_as_its_own_message(fit, capsys) -> None:
    """Raised by ``Trainer.__init__`` itself (not through jsonargparse): still one line."""
    err = _stderr(capsys, fit, "--trainer.max_epochs", "-2", code=1)
    assert err.startswith("error: MisconfigurationException: `max_epochs` must be a "
                          "non-negative integer or -1. You passed in -2."), err


@pytest.mark.parametrize("args", [["--optimizer", "torch.optim.Adam"],
                                  ["--optimizer=Adam", "--optimizer.lr", "0.1"],
                                  ["--lr_scheduler", "torch.optim.lr_scheduler.StepLR"]])
def test_lightning_automatic_optimizer_options_are_refused(fit, capsys, args) -> None:
    err = _stderr(capsys, fit, *args, code=2)
    option = args[0].partition("=")[0]
    assert err.startswith(f"error: {option}: there is no --optimizer or --lr_scheduler option")
    assert "--model.init_args.optimizer (or --model.optimizer) lars|sgd|adamw" in err


def test_automatic_optimizer_in_a_config_file_is_refused(fit, capsys, tmp_path: Path) -> None:
    extra = tmp_path / "adam.yaml"
    extra.write_text("optimizer: {class_path: torch.optim.Adam, init_args: {lr: 0.1}}\n")
    err = _stderr(capsys, fit, "--config", str(extra), code=2)
    assert err.startswith("error: --optimizer: there is no --optimizer")
    assert "--model.init_args.optimizer" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--data.init_args.batch_size", "1"],
     "error: SimCLR needs a global batch (batch_size x processes) of >= 2, got batch_size=1 x 1 "
     "process(es)"),
    (["--model.init_args.queue_size", "10"],
     "error: SimCLR.criterion.bank holds 10 embeddings, not a multiple of the global batch 4"),
    (["--model", "MoCoV2", "--model.init_args.queue_size", "10"],
     "error: MoCoV2.queue holds 10 embeddings, not a multiple of the global batch 4"),
    (["--data.init_args.root", "missing"], "error: FileNotFoundError: "),
])
def test_a_setting_refused_at_set_up_is_printed_as_one_line(fit, capsys, args, message) -> None:
    err = _stderr(capsys, fit, *args, code=1)
    assert err.startswith(message), err


def test_an_error_of_our_own_type_during_training_is_one_line(fit, capsys, monkeypatch) -> None:
    def diverge(self, *args, **kwargs):
        raise TrainingDivergedError("Training diverged: the loss is nan at global step 0.")

    monkeypatch.setattr("ssl_lightning.methods.base.check_finite_loss", diverge)
    err = _stderr(capsys, fit, code=1)
    assert err.startswith("error: TrainingDivergedError: Training diverged: the loss is nan at "
                          "global step 0. The step is captured in ")  # DivergenceCapture's
    assert "replay it with: python -m ssl_lightning replay " in err and err.count("\n") == 1


def test_a_patch_size_mismatch_of_the_training_views_is_one_line(fit, capsys) -> None:
    """Raised in the first training step (no sanity check ran): the message, not a traceback."""
    err = _stderr(capsys, fit, "--model.backbone", "ViT", "--model.backbone.init_args.image_size",
                  "28", "--model.backbone.init_args.patch_size", "14",
                  "--model.backbone.init_args.embed_dim", "8", "--model.backbone.init_args.depth",
                  "1", "--model.backbone.init_args.num_heads", "2",
                  "--trainer.num_sanity_val_steps", "0", code=1)
    assert err.startswith("error: PatchSizeError: Image size (32, 32) is not a multiple of the "
                          "ViT's patch_size 14. The images come from the training views"), err


def test_a_bug_at_set_up_keeps_its_traceback(fit, monkeypatch) -> None:
    """Raised outside ssl_lightning's checks (here: by the test), or not a settings error."""
    def fail(self) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(SimCLR, "on_fit_start", fail)
    with pytest.raises(ValueError, match="a bug"):
        fit()
    monkeypatch.setattr(SimCLR, "on_fit_start", lambda self: [][0])
    with pytest.raises(IndexError):
        fit()


def test_debug_mode_keeps_the_traceback_of_a_set_up_error(fit, monkeypatch) -> None:
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ValueError, match="SimCLR needs a global batch"):
        fit("--data.init_args.batch_size", "1")


def _spawned(error: Exception) -> ProcessRaisedException:
    """``error`` as ``ddp_spawn`` re-raises it in the main process: the text of its traceback."""
    try:
        raise error
    except Exception:
        trace = traceback.format_exc()
    return ProcessRaisedException(
        f"\n\n-- Process 1 terminated with the following error:\n{trace}", 1, 0)


def test_a_set_up_error_of_a_spawned_process_is_one_line(tmp_path: Path) -> None:
    try:
        check_directory(tmp_path / "missing")
    except FileNotFoundError as err:
        spawned = _spawned(err)
    assert run_error_message(spawned) == (
        f"FileNotFoundError: Data directory {tmp_path / 'missing'} does not exist.")
    assert run_error_message(_spawned(ValueError("raised outside ssl_lightning"))) is None
    diverged = _spawned(TrainingDivergedError("Training diverged: the loss is nan."))
    assert run_error_message(diverged) == ("TrainingDivergedError: Training diverged: the loss "
                                           "is nan.")


def test_our_error_re_raised_from_a_loader_worker_is_its_own_message() -> None:
    """torch re-raises a worker's exception with the worker's traceback in its message."""
    try:
        raise CorruptImageError("Cannot decode image 'a.jpg': truncated file.")
    except CorruptImageError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(CorruptImageError) as raised:
        wrapper.reraise()
    assert "Original Traceback" not in str(raised.value)  # CorruptImageError drops it itself
    assert run_error_message(raised.value) == (
        "CorruptImageError: Cannot decode image 'a.jpg': truncated file.")


@pytest.mark.parametrize(("option", "value"), [
    ("--trainer.max_steps", "abc"),  # int
    ("--model.temperature", "abc"),  # float
    ("--trainer.enable_checkpointing", "maybe"),  # bool
    ("--config", "no/such/file"),  # path
    ("--model.betas", "[0.9, x]"),  # list / tuple
    ("--model.backbone", "NoSuchNet"),  # class path
    ("--trainer.callbacks", "NoSuchCallback"),  # list of class paths
])
def test_every_option_kind_refuses_a_malformed_value_by_name(fit, capsys, option,
                                                             value) -> None:
    err = _stderr(capsys, fit, option, value, code=2).splitlines()[0]
    named = re.match(r"error: (\S+): (.*)", err)
    assert named is not None and named.group(1) == option, err
    assert len(named.group(2).strip()) > 10, err
