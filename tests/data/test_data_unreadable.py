"""Unreadable images while training: skip (warn, list, deterministic replacement) or raise."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.cli import main
from ssl_lightning.data import CorruptImageError, ImageFolderDataModule, ImageFolderDataset
from ssl_lightning.data.datasets import SKIPPED_IMAGES, UnreadableImages


def _folder(root: Path, make_image_folder, corrupt: int = 1) -> Path:
    """8 readable 32 px JPEGs and ``corrupt`` files that are not images, in one flat folder."""
    flat = make_image_folder(root, classes=1, per_class=8) / "class_0"
    for k in range(corrupt):
        (flat / f"{k:03d}_bad.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    return flat


def _module(folder: Path, **kwargs) -> ImageFolderDataModule:
    settings = {"preset": "cifar", "batch_size": 3, "num_workers": 0, "seed": 5,
                "max_corrupt_fraction": 0.2, "persistent_workers": False, **kwargs}
    return ImageFolderDataModule(str(folder), **settings)


def _epoch(dm: ImageFolderDataModule) -> list[torch.Tensor]:
    return [torch.cat([*views, targets.view(-1, 1, 1, 1).float().expand(-1, 3, 32, 1)], -1)
            for views, targets, _ in dm.train_dataloader()]


def test_skip_trains_to_the_end_and_lists_the_file(tmp_path: Path, make_image_folder) -> None:
    folder = _folder(tmp_path / "data", make_image_folder)
    model = SimCLR(SmallConvNet((4, 8)), projection_hidden_dim=8, projection_dim=4,
                   head_batch_norm=False, optimizer="sgd", lr=0.1, lr_scaling="none",
                   warmup_epochs=0)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path / "run")
    with pytest.warns(UserWarning, match=r"Skipping an unreadable image .*000_bad\.jpg"):
        trainer.fit(model, datamodule=_module(folder))
    assert trainer.global_step == 6  # 9 samples, batch 3, 2 epochs: nothing dropped
    listed = (Path(trainer.log_dir) / SKIPPED_IMAGES).read_text().splitlines()
    assert listed == [str(folder / "000_bad.jpg")]  # once, though read in both epochs


def test_replacement_is_the_same_for_0_and_2_workers(tmp_path: Path, make_image_folder) -> None:
    folder = _folder(tmp_path / "data", make_image_folder)
    with pytest.warns(UserWarning, match="000_bad.jpg"):
        serial = _epoch(_module(folder))
    parallel = _epoch(_module(folder, num_workers=2))
    assert len(serial) == len(parallel) == 3
    assert all(torch.equal(a, b) for a, b in zip(serial, parallel, strict=True))


def test_replacement_depends_only_on_the_sample(tmp_path: Path, make_image_folder) -> None:
    folder = _folder(tmp_path / "data", make_image_folder)
    dataset = ImageFolderDataset(folder, unreadable=UnreadableImages("skip", 0.2))
    bad = [path for path, _ in dataset.samples].index(str(folder / "000_bad.jpg"))
    with pytest.warns(UserWarning, match="000_bad.jpg"):
        first = dataset[bad][0].tobytes()
    again = ImageFolderDataset(folder, unreadable=UnreadableImages("skip", 0.2))[bad]
    assert first == again[0].tobytes()  # a fresh process picks the same image
    assert first in {dataset[i][0].tobytes() for i in range(len(dataset)) if i != bad}


def test_too_many_unreadable_images_stop_the_run(tmp_path: Path, make_image_folder) -> None:
    folder = _folder(tmp_path / "data", make_image_folder, corrupt=2)  # 2 of 10
    with pytest.raises(CorruptImageError, match=r"2 of the 10 images under .* are unreadable, "
                                                r"more than max_corrupt_fraction=0.1 .*"
                                                r"\(--data.max_corrupt_fraction 0.2 allows "
                                                r"2\)"):
        _epoch(_module(folder, max_corrupt_fraction=0.1, batch_size=2))


def test_raise_mode_prints_one_line_naming_the_file(
    tmp_path: Path, make_image_folder, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    folder = _folder(tmp_path / "data", make_image_folder)
    config = {
        "model": {"class_path": "SimCLR", "init_args": {
            "backbone": {"class_path": "SmallConvNet", "init_args": {"widths": [4, 8]}},
            "projection_hidden_dim": 8, "projection_dim": 4, "head_batch_norm": False}},
        "data": {"class_path": "ImageFolderDataModule", "init_args": {
            "train_dir": str(folder), "preset": "cifar", "batch_size": 3, "num_workers": 2,
            "on_error": "raise"}},
        "trainer": {"accelerator": "cpu", "max_epochs": 1, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(
        f"error: CorruptImageError: Cannot read image file {folder / '000_bad.jpg'}: ")


def test_corrupt_image_error_from_a_worker_keeps_one_line() -> None:
    wrapped = ("Caught CorruptImageError in DataLoader worker process 0.\nOriginal Traceback "
               "(most recent call last):\n  File \"x.py\", line 1, in f\nssl_lightning.data."
               "datasets.CorruptImageError: Cannot read image file a.jpg: broken.\n")
    assert str(CorruptImageError(wrapped)) == "Cannot read image file a.jpg: broken."


def test_bad_policy_arguments() -> None:
    with pytest.raises(ValueError, match="on_error must be 'skip' or 'raise', got 'ignore'"):
        ImageFolderDataModule("x", on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_corrupt_fraction must be in \[0, 1\], got 2"):
        ImageFolderDataModule("x", max_corrupt_fraction=2)
