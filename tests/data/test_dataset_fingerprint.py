"""A checkpoint written inside an epoch records the file list of its training set (names and
sizes); resuming it on another folder with the same names and the same number of images is
refused before the first step, and on its own folder it resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data import ImageFolderDataModule, SimCLRViews
from ssl_lightning.data.fingerprint import dataset_fingerprint
from ssl_lightning.methods import SimCLR


def _fit(train: Path, root: Path, max_steps: int, ckpt_path: str | None = None,
         callbacks: tuple[pl.Callback, ...] = ()) -> pl.Trainer:
    torch.manual_seed(0)
    model = SimCLR(SmallConvNet((4, 8), norm="group"), projection_hidden_dim=8, projection_dim=4,
                   optimizer="sgd", lr=0.1, warmup_epochs=0, image_size=16)
    data = ImageFolderDataModule(str(train), preset="cifar", batch_size=4, num_workers=0,
                                 train_transform=SimCLRViews("cifar", crop_size=16))
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False,
                         enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=str(root))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def test_mid_epoch_resume_on_other_files_of_the_same_size_is_refused(
        tmp_path: Path, make_image_folder) -> None:  # type: ignore[no-untyped-def]
    first = make_image_folder(tmp_path / "first", classes=2, per_class=12, seed=0)
    other = make_image_folder(tmp_path / "other", classes=2, per_class=12, seed=5)
    assert sorted(p.relative_to(first) for p in first.rglob("*.jpg")) == \
        sorted(p.relative_to(other) for p in other.rglob("*.jpg"))  # the same names
    _fit(first, tmp_path, 2, callbacks=(ModelCheckpoint(tmp_path / "ckpt", filename="{step}",
                                                        save_top_k=-1, every_n_train_steps=1),))
    checkpoint = str(tmp_path / "ckpt" / "step=2.ckpt")  # inside epoch 0 (6 steps)
    saved = torch.load(checkpoint, weights_only=True)["ImageFolderDataModule"]
    assert len(saved["dataset_fingerprint"]) == 64

    with pytest.raises(ValueError, match="written inside an epoch on another training set"):
        _fit(other, tmp_path, 3, ckpt_path=checkpoint)
    assert _fit(first, tmp_path, 3, ckpt_path=checkpoint).global_step == 3


def test_fingerprint_reads_names_relative_to_the_root_and_sizes(tmp_path: Path) -> None:
    class Files:
        def __init__(self, root: Path) -> None:
            self.root = str(root)
            self.samples = [(str(root / "a.jpg"), 0), (str(root / "b.jpg"), 1)]

    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.jpg").write_bytes(b"123")
        (tmp_path / folder / "b.jpg").write_bytes(b"45")
    assert dataset_fingerprint(Files(tmp_path / "x")) == dataset_fingerprint(Files(tmp_path / "y"))
    (tmp_path / "y" / "b.jpg").write_bytes(b"456")  # one size differs
    assert dataset_fingerprint(Files(tmp_path / "x")) != dataset_fingerprint(Files(tmp_path / "y"))
