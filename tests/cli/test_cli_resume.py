"""``--ckpt_path`` through the real CLI (``ssl_lightning.cli.main``).

A 1-epoch SimCLR run (tiny image folder: 24 images, batch 4 -> 6 steps) writes the checkpoint
every test resumes from. The resumed lr is compared with WarmupCosine written out from its
formula; hyperparameter overrides must reach the model and the optimiser; a checkpoint of
another method, optimiser or architecture, or a damaged file, is refused before training.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from ssl_lightning.cli import main

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  logger: false
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {save_last: true, dirpath: ckpts}
    - class_path: test_cli_resume.LrRecorder
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
    lr_scaling: linear
    warmup_epochs: 0.5
data:
  class_path: CIFAR10DataModule
  init_args: {batch_size: 4, num_workers: 0}
"""


class LrRecorder(pl.Callback):
    """Records ``(global_step, lr of every group)`` before each optimiser step."""

    def __init__(self) -> None:
        self.lrs: list[tuple[int, list[float]]] = []
        self.wds: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append((trainer.global_step,
                         [g["lr"] for g in trainer.optimizers[0].param_groups]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The decay group's weight decay of the optimiser step just taken."""
        self.wds.append((trainer.global_step - 1,
                         trainer.optimizers[0].param_groups[0]["weight_decay"]))


def recorder(cli) -> LrRecorder:
    return next(c for c in cli.trainer.callbacks if isinstance(c, LrRecorder))


def recorded(cli) -> list[tuple[int, list[float]]]:
    return recorder(cli).lrs


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The schedule from its definition: linear warm-up to 1, then half a cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_image_folder):
    """The 1-epoch run: ``(directory, config path, checkpoint path, its lr per step)``."""
    root = tmp_path_factory.mktemp("resume")
    config = yaml.safe_load(CONFIG)
    config["data"]["init_args"]["root"] = str(tiny_image_folder)
    path = root / "tiny.yaml"  # not config.yaml: the CLI writes its own there
    path.write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        cli = main(["fit", "--config", str(path)])
    checkpoint = root / "epoch1.ckpt"
    shutil.copy(root / "ckpts" / "last.ckpt", checkpoint)
    return root, path, str(checkpoint), recorded(cli)


@pytest.fixture
def resume(first_run, monkeypatch):
    root, config, checkpoint, _ = first_run
    monkeypatch.chdir(root)

    def run(*args: str, ckpt: str = checkpoint, config_path: Path = config):
        return main(["fit", "--config", str(config_path), "--ckpt_path", ckpt, *args])

    return run


def test_resume_to_two_epochs_follows_the_two_epoch_cosine(first_run, resume) -> None:
    peak = 0.1 * 4 / 256
    lrs = first_run[3]
    assert [s for s, _ in lrs] == list(range(6))
    for step, values in lrs:  # the first leg: 6 steps, warm-up 3 (0.5 epoch)
        assert values == pytest.approx([peak * warmup_cosine(step, 3, 6)] * 2, rel=1e-12)
    with pytest.warns(UserWarning, match=r"changed schedule: total steps 6 -> 12"):
        cli = resume("--trainer.max_epochs", "2")
    lrs = recorded(cli)
    assert [s for s, _ in lrs] == list(range(6, 12))
    for step, values in lrs:
        expected = peak * warmup_cosine(step, 3, 12)
        assert expected > 1e-5 and values == pytest.approx([expected] * 2, rel=1e-12)


def test_resume_with_a_larger_batch_and_overrides_uses_the_new_values(resume) -> None:
    with pytest.warns(UserWarning) as record:
        cli = resume("--trainer.max_epochs", "2", "--data.batch_size", "8", "--model.lr", "0.08",
                     "--model.init_args.temperature", "0.3", "--model.weight_decay", "0.001",
                     "--model.weight_decay_end", "0.01")
    messages = [str(w.message) for w in record]
    hparams = [m for m in messages if "hyperparameter(s) that differ" in m]
    assert len(hparams) == 1, messages  # ONE warning listing every difference
    for item in ("lr: 0.1 (checkpoint) -> 0.08 (this run)", "temperature: 0.2 (checkpoint) -> "
                 "0.3 (this run)", "weight_decay: 1e-06 (checkpoint) -> 0.001 (this run)"):
        assert item in hparams[0]
    assert "This run's values are used" in hparams[0]
    schedule = next(m for m in messages if "changed schedule" in m)
    assert "steps per epoch 6 -> 3; global batch 4 -> 8; peak lr 0.0015625 -> 0.0025" in schedule
    assert cli.model.criterion.temperature == 0.3
    groups = cli.trainer.optimizers[0].param_groups
    assert groups[1]["weight_decay"] == 0.0  # biases/norms; the decay group: see below
    # 1 of 2 epochs done = position 3 of the new 6-step schedule (3 steps per epoch,
    # warm-up round(0.5 * 3) = 2), at the new global batch's peak lr.
    peak = 0.08 * 8 / 256  # the new lr scaled for the new global batch
    lrs = recorded(cli)
    assert [s for s, _ in lrs] == [6, 7, 8]
    for step, values in lrs:
        expected = peak * warmup_cosine(step - 3, 2, 6)
        assert expected > 1e-5 and values == pytest.approx([expected] * 2, rel=1e-12)
    # The weight-decay cosine takes the same converted position (step 3 of 6), not step 6 (its
    # end, 0.01): 0.01 - 0.009 * (cos(pi * position / 6) + 1) / 2.
    wds = recorder(cli).wds
    assert [s for s, _ in wds] == [6, 7, 8]
    for step, value in wds:
        expected = 0.01 - 0.009 * (math.cos(math.pi * (step - 3) / 6) + 1) / 2
        assert value == pytest.approx(expected, rel=1e-12)


def _error(capsys, run, *args: str, **kwargs) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run(*args, **kwargs)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err
    return err


def test_checkpoint_of_another_method_is_refused(first_run, resume, capsys, tmp_path) -> None:
    byol = yaml.safe_load(first_run[1].read_text())
    byol["model"]["class_path"] = "BYOL"
    del byol["model"]["init_args"]["head_batch_norm"]
    path = tmp_path / "byol.yaml"
    path.write_text(yaml.safe_dump(byol))
    err = _error(capsys, resume, config_path=path)
    assert ("is a ssl_lightning.SimCLR checkpoint, the config's model is ssl_lightning.BYOL: "
            "resuming needs the same method") in err


def test_another_optimizer_or_architecture_is_refused(resume, capsys) -> None:
    err = _error(capsys, resume, "--model.optimizer", "lars")
    assert "trained with optimizer='sgd', this run sets optimizer='lars'" in err
    with pytest.warns(UserWarning, match="projection_dim: 8 .checkpoint. -> 4"):
        err = _error(capsys, resume, "--model.projection_dim", "4")
    assert "does not fit the configured SimCLR: 2 shape mismatches" in err
    assert "projector.mlp.2.weight (8, 16) in the checkpoint, (4, 16) configured" in err


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_damaged_checkpoint_is_named_with_what_to_do(first_run, resume, capsys, tmp_path,
                                                    damage) -> None:
    path = tmp_path / f"{damage}.ckpt"
    if damage != "missing":
        data = Path(first_run[2]).read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    err = _error(capsys, resume, ckpt=str(path))
    assert str(path) in err
    if damage == "missing":
        assert "Checkpoint file not found" in err
    else:
        assert ("is empty (0 bytes)" if damage == "empty" else "cannot be read") in err
        assert "Resume from the previous checkpoint" in err


def _logged_run(root: Path, config: Path, *args: str) -> None:
    """``fit`` with a CSV logger in ``root/runs/tiny`` and ModelCheckpoint's default folder."""
    logged = yaml.safe_load(config.read_text())
    logged["trainer"]["logger"] = {"class_path": "pytorch_lightning.loggers.CSVLogger",
                                   "init_args": {"save_dir": str(root / "runs"), "name": "tiny"}}
    del logged["trainer"]["callbacks"][0]["init_args"]["dirpath"]
    path = root / "logged.yaml"
    path.write_text(yaml.safe_dump(logged))
    main(["fit", "--config", str(path), *args])


def test_resume_with_changed_settings_keeps_the_original_run(first_run, resume,
                                                             tmp_path, monkeypatch) -> None:
    """The original run's last.ckpt survives a resume with another lr: beside it as
    last-before-resume.ckpt (a fixed checkpoint folder), or untouched in its version folder
    (the resumed run writes a new one); --resume_in_place replaces it."""
    root = first_run[0]
    folder = root / "ckpts"
    before = {p.name for p in folder.glob("last-before-resume*.ckpt")}
    original = (folder / "last.ckpt").read_bytes()
    with pytest.warns(UserWarning, match="The original run is kept"):
        resume("--model.lr", "0.05", "--trainer.max_epochs", "2")
    new = [p for p in folder.glob("last-before-resume*.ckpt") if p.name not in before]
    assert len(new) == 1 and new[0].read_bytes() == original
    assert (folder / "last.ckpt").read_bytes() != original  # the resumed run's

    monkeypatch.chdir(tmp_path)
    _logged_run(tmp_path, first_run[1])
    last = tmp_path / "runs/tiny/version_0/checkpoints/last.ckpt"
    original = last.read_bytes()
    _logged_run(tmp_path, first_run[1], "--ckpt_path", str(last), "--model.lr", "0.05",
                "--trainer.max_epochs", "2")
    assert last.read_bytes() == original
    assert torch.load(tmp_path / "runs/tiny/version_1/checkpoints/last.ckpt",
                      weights_only=True)["global_step"] == 12
    with pytest.warns(UserWarning, match="--resume_in_place: this run continues"):
        _logged_run(tmp_path, first_run[1], "--ckpt_path", str(last), "--model.lr", "0.05",
                    "--trainer.max_epochs", "2", "--resume_in_place", "true")
    assert torch.load(last, weights_only=True)["global_step"] == 12
    assert not (tmp_path / "runs/tiny/version_2").exists()
