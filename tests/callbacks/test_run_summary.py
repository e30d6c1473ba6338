"""The console summary of a run (RunSummary, in every pre-training config): what is trained on
what at fit start, what came out and how to resume or evaluate at fit end, and where a resumed
run continues."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from ssl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL_CONVNET = '{"class_path": "ssl_lightning.SmallConvNet", "init_args": {"widths": [8, 16]}}'


def run_args(data: Path, runs: Path, max_steps: int) -> list[str]:
    return [
        "fit", "--config", str(ROOT / "configs" / "simclr.yaml"),
        "--model.backbone", SMALL_CONVNET, "--model.projection_hidden_dim", "32",
        "--model.projection_dim", "16",
        "--data.root", str(data), "--data.batch_size", "4", "--data.num_workers", "0",
        "--data.knn_train_subset", "null",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.precision", "32-true", "--trainer.max_steps", str(max_steps),
        "--trainer.max_epochs", "4", "--trainer.limit_val_batches", "1",
        "--trainer.check_val_every_n_epoch", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.logger.init_args.save_dir", str(runs),
    ]


@pytest.fixture(scope="module")
def finished_run(tiny_image_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    runs = tmp_path_factory.mktemp("summary_runs")
    cli = main(run_args(tiny_image_folder, runs, max_steps=8))
    summary = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RunSummary")
    return cli, summary, runs


def test_the_start_summary_names_the_run(finished_run) -> None:
    cli, summary, runs = finished_run
    text = "\n".join(summary.lines_at_start)
    assert text.startswith("== SimCLR · backbone SmallConvNet (")
    assert "24 training images, labeled, 2 classes" in text
    assert "batch: 4 per device x 1 device(s) = 4 global" in text
    assert "6 steps per epoch, 8 steps in all" in text
    # lars with sqrt scaling: 0.045 * sqrt(4) = 0.09
    assert "peak lr 0.09 (after lr scaling)" in text
    assert "precision 32-true" in text
    assert f"run directory: {runs / 'simclr' / 'version_0'}" in text
    assert "every 500 steps" in text and "the best val/knn_top1 (max)" in text


def test_the_end_summary_reports_results_and_commands(finished_run) -> None:
    cli, summary, runs = finished_run
    text = "\n".join(summary.lines_at_end)
    knn = float(cli.trainer.callback_metrics["val/knn_top1"])
    assert f"val/knn_top1: {knn:.4g} (last), best " in text
    assert "val/probe_top1:" in text
    last = runs / "simclr" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"last checkpoint: {last}" in text
    resume = next(line for line in summary.lines_at_end if "resume:" in line)
    command = shlex.split(resume.split("resume: ", 1)[1])
    assert command[:3] == ["python", "-m", "ssl_lightning"]
    assert Path(command[command.index("--config") + 1]).is_file()
    assert command[command.index("--ckpt_path") + 1] == str(last)
    evaluate = next(line for line in summary.lines_at_end if "evaluate:" in line)
    command = shlex.split(evaluate.split("evaluate: ", 1)[1])
    # a shipped config's name, which --config finds from any working directory
    assert command[command.index("--config") + 1] == "linear"
    assert command[command.index("--model.checkpoint") + 1] == str(last)
    exported = runs / "simclr" / "version_0" / "export" / "backbone.pt"
    assert f"exported backbone: {exported}" in text and exported.is_file()


def test_a_resumed_run_says_where_it_continues(finished_run, tiny_image_folder: Path,
                                               tmp_path: Path) -> None:
    _, _, runs = finished_run
    last = runs / "simclr" / "version_0" / "checkpoints" / "last.ckpt"
    cli = main([*run_args(tiny_image_folder, tmp_path, max_steps=10), "--ckpt_path", str(last)])
    summary = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RunSummary")
    line = next(line for line in summary.lines_at_start if "resuming from" in line)
    assert line.endswith("continues at step 8, epoch 1 (batch 2 of 6, mid-epoch)")


def test_a_resumed_run_writes_into_its_own_run_directory(finished_run,
                                                         tiny_image_folder: Path) -> None:
    """``--ckpt_path <run>/checkpoints/last.ckpt`` continues in ``<run>``, not a new version."""
    _, _, runs = finished_run
    version = runs / "simclr" / "version_0"
    cli = main([*run_args(tiny_image_folder, runs, max_steps=10),
                "--ckpt_path", str(version / "checkpoints" / "last.ckpt")])
    assert cli.trainer.global_step == 10
    assert sorted(p.name for p in (runs / "simclr").iterdir()) == ["version_0"]
    summary = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RunSummary")
    assert f"run directory: {version}" in "\n".join(summary.lines_at_start)
    assert torch.load(version / "checkpoints" / "last.ckpt", weights_only=True)[
        "global_step"] == 10


def test_ckpt_path_last_starts_a_run_then_resumes_it(tiny_image_folder: Path,
                                                     tmp_path: Path) -> None:
    """One command for a requeued job: ``--ckpt_path last`` starts a new run while the logger's
    folder has no ``last.ckpt``, and later resumes the newest one in its own run directory."""
    first = main([*run_args(tiny_image_folder, tmp_path, max_steps=4), "--ckpt_path", "last"])
    assert first.trainer.global_step == 4
    version = tmp_path / "simclr" / "version_0"
    assert (version / "checkpoints" / "last.ckpt").is_file()
    again = main([*run_args(tiny_image_folder, tmp_path, max_steps=6), "--ckpt_path", "last"])
    summary = next(cb for cb in again.trainer.callbacks if type(cb).__name__ == "RunSummary")
    assert any("continues at step 4" in line for line in summary.lines_at_start)
    assert again.trainer.global_step == 6
    assert sorted(p.name for p in (tmp_path / "simclr").iterdir()) == ["version_0"]


def test_the_printed_evaluate_command_runs_and_says_when_no_validation_ran(
        finished_run, tiny_image_folder: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, summary, _ = finished_run
    evaluate = next(line for line in summary.lines_at_end if "evaluate:" in line)
    monkeypatch.chdir(tmp_path)  # the shipped config is found from any directory
    command = shlex.split(evaluate.split("evaluate: ", 1)[1])[3:]
    cli = main([*command, "--data.root", str(tiny_image_folder), "--data.batch_size", "8",
                "--data.num_workers", "0", "--trainer.accelerator", "cpu",
                "--trainer.max_epochs", "1", "--trainer.num_sanity_val_steps", "0",
                "--trainer.logger.init_args.save_dir", str(tmp_path)])
    lines = next(cb for cb in cli.trainer.callbacks
                 if type(cb).__name__ == "RunSummary").lines_at_end
    # configs/linear.yaml validates every 5 epochs: a 1-epoch run logs no val/top1
    assert ("   no validation ran: check_val_every_n_epoch=5 and the run ended after 1 epoch(s); "
            "--trainer.check_val_every_n_epoch 1 validates every epoch") in lines


def test_a_sharded_last_checkpoint_folder_is_reported(tmp_path: Path) -> None:
    """A sharded run's last.ckpt is a folder (torch DCP): the end summary still names it, and
    with it the resume command."""
    from types import SimpleNamespace

    from pytorch_lightning.callbacks import ModelCheckpoint

    from ssl_lightning.callbacks.run_summary import _last_checkpoint

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    checkpoint.last_model_path = str(folder)
    assert _last_checkpoint(SimpleNamespace(callbacks=[checkpoint])) == str(folder)
