"""Experiment trackers through the CLI: MLflow (local file store), W&B (offline), real loggers;
each run's config, picture and exported backbone among its own artifacts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SIMCLR = ROOT / "configs" / "simclr.yaml"
STEPS = ["--trainer.fast_dev_run", "false", "--trainer.max_steps", "2",
         "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1"]
#: Two training steps and one validation at the end of the epoch (the picture needs one).
EPOCH = ["--trainer.fast_dev_run", "false", "--trainer.max_epochs", "1",
         "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
         "--trainer.check_val_every_n_epoch", "1"]


def mlflow_args(uri: str) -> list[str]:
    return ["--trainer.logger", "pytorch_lightning.loggers.MLFlowLogger",
            "--trainer.logger.init_args.experiment_name", "simclr",
            "--trainer.logger.init_args.tracking_uri", uri]


def printed_snippet(out: str) -> str:
    """The load lines ExportBackbone printed last: after "Load it with:", to load_state_dict."""
    lines = out.rsplit("Load it with:\n", 1)[1].splitlines()
    end = next(i for i, line in enumerate(lines) if "load_state_dict(" in line)
    return "\n".join(lines[:end + 1])


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


def test_mlflow_runs_keep_their_own_config_picture_and_export(run_config, tmp_path, monkeypatch,
                                                              capsys):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    for temperature in ("0.3", "0.4"):
        cli = run_config(SIMCLR, [*EPOCH, *mlflow_args(uri), "--model.temperature", temperature])
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("simclr").experiment_id])
    assert len(runs) == 2
    for run in runs:
        run_id = run.info.run_id
        top = {a.path for a in client.list_artifacts(run_id)}
        assert top == {"config.yaml", "embeddings_fit_epoch000.png", "export"}
        assert {a.path for a in client.list_artifacts(run_id, "export")} == {"export/backbone.pt"}
        config = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / run_id)))
        assert f"temperature: {run.data.params['temperature']}" in config.read_text()
    # nothing shared by the runs in the tracking directory itself
    assert not list((tmp_path / "mlruns").glob("*.yaml")) + list(
        (tmp_path / "mlruns").glob("*.png"))
    # the printed lines load the exported file into torchvision's ResNet-18
    namespace: dict = {}
    exec(printed_snippet(capsys.readouterr().out), namespace)
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same modules and weights: the same kernels, bit for bit
        assert torch.equal(namespace["model"].eval()(images), cli.model.backbone.eval()(images))


def test_wandb_offline_run_logs_config_and_export_as_artifacts(run_config, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in [("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"),
                        ("WANDB_DIR", str(tmp_path)), ("WANDB_CACHE_DIR", str(tmp_path / "cache")),
                        ("WANDB_DATA_DIR", str(tmp_path / "data"))]:
        monkeypatch.setenv(name, value)
    cli = run_config(SIMCLR, [*STEPS, "--trainer.logger", "pytorch_lightning.loggers.WandbLogger",
                              "--trainer.logger.init_args.project", "ssl-lightning-test",
                              "--trainer.logger.init_args.offline", "true",
                              "--trainer.logger.init_args.save_dir", str(tmp_path)])
    run_id = cli.trainer.logger.experiment.id
    cli.trainer.logger.experiment.finish()
    wandb.teardown()  # waits for the service to flush the offline run file
    run_dir = tmp_path / "ssl-lightning-test" / run_id
    assert (run_dir / "config.yaml").is_file() and (run_dir / "export" / "backbone.pt").is_file()
    (run_file,) = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    records = run_file.read_bytes()
    for artifact in (f"run-{run_id}-config.yaml", f"run-{run_id}-export-backbone.pt"):
        assert artifact.encode() in records
