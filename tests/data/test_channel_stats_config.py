"""``channel-stats --output stats.yaml``: the statistics written once, as a config piece that a
pre-training config composes; the run's checkpoint then carries them to ``embed``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ssl_lightning.cli import main
from ssl_lightning.cli.channel_stats import main as channel_stats_main
from ssl_lightning.data import MultiChannelEval
from ssl_lightning.data.arrays import load_array
from ssl_lightning.evaluation.embed import embed_folder
from ssl_lightning.evaluation.embed_writers import read_sidecar

ROOT = Path(__file__).resolve().parents[2]


def test_the_stats_piece_composes_with_a_method_config(tmp_path, monkeypatch, capsys):
    for split, per_class in (("train", 4), ("test", 2)):
        for c in range(2):
            folder = tmp_path / "data" / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                rng = np.random.default_rng(10 * c + i)
                np.save(folder / f"{i}.npy", rng.integers(0, 4000, (4, 16, 16), dtype=np.uint16))
    monkeypatch.chdir(tmp_path)
    mean, std, _ = channel_stats_main(["--images", "data/train", "--output", "stats.yaml"])
    assert "Wrote stats.yaml" in capsys.readouterr().out
    cli = main([
        "fit", "--config", str(ROOT / "configs" / "simclr.yaml"), "--config", "stats.yaml",
        "--model.backbone", '{"class_path": "ssl_lightning.SmallConvNet", "init_args": '
                            '{"widths": [8, 16], "in_chans": 4}}',
        "--model.projection_hidden_dim", "16", "--model.projection_dim", "8",
        "--data.train_dir", "data/train", "--data.val_dir", "data/test",
        "--data.train_transform.init_args.crop_size", "16",
        "--data.eval_transform.init_args.crop_size", "16",
        "--data.batch_size", "4", "--data.num_workers", "0",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.precision", "32-true",
        "--trainer.callbacks.init_args.enabled", "false",
    ])
    path = str(tmp_path / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    record = torch.load(path, weights_only=True)["preprocessing"]
    assert (record["image_reader"], record["channels"]) == ("array", 4)
    assert record["mean"] == pytest.approx(mean, rel=1e-12)
    assert record["std"] == pytest.approx(std, rel=1e-12)
    # embed without a flag: the reader, crop and the 4 channel statistics from the checkpoint
    embed_folder(path, "data/test", "emb.npy")
    transform = MultiChannelEval(mean, std, crop_size=16)
    with torch.no_grad():
        by_hand = cli.model.backbone.eval()(torch.stack(
            [transform(load_array(p)) for p in read_sidecar("emb.npy")[0]])).numpy()
    np.testing.assert_allclose(np.load("emb.npy"), by_hand, rtol=0, atol=1e-5)


def test_an_existing_output_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "img").mkdir()
    np.save(tmp_path / "img" / "a.npy", np.zeros((2, 4, 4), np.uint16))
    (tmp_path / "stats.yaml").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        channel_stats_main(["--images", str(tmp_path / "img"), "--output",
                            str(tmp_path / "stats.yaml")])
    assert exit_info.value.code == 2 and "exists" in capsys.readouterr().err
    assert (tmp_path / "stats.yaml").read_text() == "mine"
