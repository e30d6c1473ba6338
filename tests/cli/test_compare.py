"""results.json (written by RunSummary when a fit ends) and ``python -m ssl_lightning compare``
on two tiny runs: the table's rows are the files' numbers, the picture holds both runs' curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL_CONVNET = '{"class_path": "ssl_lightning.SmallConvNet", "init_args": {"widths": [8, 16]}}'


def _fit(data: Path, runs: Path, name: str, temperature: str) -> Path:
    cli = main([
        "fit", "--config", str(ROOT / "configs" / "simclr.yaml"),
        "--model.backbone", SMALL_CONVNET, "--model.projection_hidden_dim", "32",
        "--model.projection_dim", "16", "--model.temperature", temperature,
        "--data.root", str(data), "--data.batch_size", "4", "--data.num_workers", "0",
        "--data.knn_train_subset", "null", "--trainer.accelerator", "cpu",
        "--trainer.devices", "1", "--trainer.precision", "32-true", "--trainer.max_steps", "12",
        "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "1",
        "--trainer.check_val_every_n_epoch", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1",
        "--trainer.logger.init_args.save_dir", str(runs), "--trainer.logger.init_args.name", name,
    ])
    return Path(cli.trainer.logger.log_dir), cli


@pytest.fixture(scope="module")
def two_runs(tiny_image_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    runs = tmp_path_factory.mktemp("compare_runs")
    return runs, [_fit(tiny_image_folder, runs, name, t)
                  for name, t in (("warm", "0.5"), ("cold", "0.1"))]


def test_each_run_writes_its_results_file(two_runs) -> None:
    _, fitted = two_runs
    for run, cli in fitted:
        record = json.loads((run / "results.json").read_text())
        knn = record["metrics"]["val/knn_top1"]
        assert knn["last"] == pytest.approx(float(cli.trainer.callback_metrics["val/knn_top1"]))
        checkpoint = next(cb for cb in cli.trainer.callbacks
                          if getattr(cb, "monitor", None) == "val/knn_top1")
        assert knn["best"] == pytest.approx(float(checkpoint.best_model_score))
        assert record["method"] == "SimCLR" and record["backbone"] == "SmallConvNet"
        assert record["step"] == 12 and record["epoch"] == 2
        assert Path(record["last_checkpoint"]) == run / "checkpoints" / "last.ckpt"
        assert Path(record["config"]).is_file()
        assert record["exported_backbones"] and Path(record["exported_backbones"][0]).is_file()
        assert not list(run.glob("*.tmp*"))  # written under a temporary name, then renamed


def test_compare_prints_one_row_per_run_and_draws_both(two_runs, tmp_path, capsys) -> None:
    runs, fitted = two_runs
    picture = tmp_path / "curves.png"
    rows = main(["compare", str(runs), "--plot", str(picture)])
    out = capsys.readouterr().out
    assert rows[0][:5] == ["run", "method", "backbone", "data", "step"]
    assert {row[0] for row in rows[1:]} == {str(run) for run, _ in fitted}
    for run, cli in fitted:
        row = next(r for r in rows if r[0] == str(run))
        knn = float(cli.trainer.callback_metrics["val/knn_top1"])
        assert row[rows[0].index("val/knn_top1")].startswith(f"{knn:.4g}")
        assert row[4] == "12" and str(run) in out
    assert "Drew val/knn_top1, train/loss of 2 run(s)" in out
    from PIL import Image

    assert Image.open(picture).size[0] > 500
    # A glob and a single results.json name the same runs.
    same = main(["compare", str(runs / "*" / "version_0")])
    assert [r[0] for r in same] == [r[0] for r in rows]
    assert len(main(["compare", str(fitted[0][0] / "results.json")])) == 2


def test_curves_come_from_the_event_files(two_runs) -> None:
    from ssl_lightning.cli.compare import read_curves

    _, fitted = two_runs
    curves = read_curves(fitted[0][0], ["train/loss", "val/knn_top1"])
    assert [step for step, _ in curves["val/knn_top1"]] == [5, 11]  # one per epoch
    assert len(curves["train/loss"]) >= 10


def test_no_runs_is_one_error_line(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    for argument in (str(tmp_path / "empty"), str(tmp_path / "nowhere")):
        with pytest.raises(SystemExit) as exit_info:
            main(["compare", argument])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: compare: no finished run")
        assert argument in err


def test_curves_from_a_csv_log(tmp_path) -> None:
    from ssl_lightning.cli.compare import read_curves

    (tmp_path / "metrics.csv").write_text(
        "epoch,step,train/loss_step,val/knn_top1\n0,0,2.5,\n0,1,2.25,\n0,1,,50.0\n1,3,2.0,75.0\n")
    assert read_curves(tmp_path, ["train/loss", "val/knn_top1", "val/top1"]) == {
        "train/loss": [(0, 2.5), (1, 2.25), (3, 2.0)], "val/knn_top1": [(1, 50.0), (3, 75.0)]}


def test_without_a_logger_no_results_file_is_written(tiny_image_folder, tmp_path) -> None:
    from ssl_lightning import ImageFolderDataModule, RunSummary, SimCLR, SmallConvNet
    from ssl_lightning._lightning import pl

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, default_root_dir=tmp_path,
                         limit_val_batches=0, callbacks=[RunSummary()])
    trainer.fit(SimCLR(SmallConvNet(widths=(8, 16)), projection_hidden_dim=16, projection_dim=8),
                ImageFolderDataModule(str(tiny_image_folder / "train"), batch_size=4,
                                      num_workers=0, preset="cifar"))
    assert trainer.global_step == 1 and list(tmp_path.iterdir()) == []
