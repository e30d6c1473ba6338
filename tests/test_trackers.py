"""Experiment trackers through the CLI: MLflow (local file store), W&B (offline), real loggers."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIMCLR = ROOT / "configs" / "simclr.yaml"
STEPS = ["--trainer.fast_dev_run", "false", "--trainer.max_steps", "2",
         "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1"]


def test_mlflow_logger_records_train_loss(run_config, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file: stores opt-in
    uri = (tmp_path / "mlruns").as_uri()
    run_config(SIMCLR, [*STEPS, "--trainer.logger", "pytorch_lightning.loggers.MLFlowLogger",
                        "--trainer.logger.init_args.experiment_name", "simclr",
                        "--trainer.logger.init_args.tracking_uri", uri])
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("simclr")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss_step")
    assert len(history) == 2 and all(m.value == m.value for m in history)  # finite, per step


def test_wandb_offline_logger_records_train_loss(run_config, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cli = run_config(SIMCLR, [*STEPS, "--trainer.logger", "pytorch_lightning.loggers.WandbLogger",
                              "--trainer.logger.init_args.project", "ssl-lightning-test",
                              "--trainer.logger.init_args.offline", "true",
                              "--trainer.logger.init_args.save_dir", str(tmp_path)])
    cli.trainer.logger.experiment.finish()
    # `finish` returns before the wandb-core service has flushed the offline run file (a race
    # that a loaded machine loses); `teardown` waits for the service process to shut down
    wandb.teardown()
    # the offline run file (what `wandb sync` uploads) holds one history record per logged
    # step; its protobuf records carry the metric keys as plain strings
    (run_file,) = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    records = run_file.read_bytes()
    assert records.count(b"train/loss_step") >= 2
