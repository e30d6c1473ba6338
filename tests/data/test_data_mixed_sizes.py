"""Images of several sizes in every preset and view path, and the image-size warning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
from PIL import Image

from ssl_lightning import SimCLR, SmallConvNet
from ssl_lightning.data import DeviceViews, ImageFolderDataModule, LinearEvalTransform

SIZES = [(20, 30), (64, 64), (300, 200)]  # (width, height)


def _mixed_folder(root: Path, classes: int = 2) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for k, (w, h) in enumerate(SIZES):
            pixels = rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{k}.jpg")
    return root


@pytest.mark.parametrize("preset", ["cifar", "imagenet"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_image", "device_views"])
def test_mixed_sizes_train_a_step(tmp_path: Path, preset: str, batched: bool) -> None:
    folder = _mixed_folder(tmp_path / "images")
    dm = ImageFolderDataModule(str(folder), str(folder), preset=preset, batch_size=3,
                               num_workers=0, device_transform=DeviceViews(preset) if batched
                               else None)
    model = SimCLR(SmallConvNet((4, 8)), projection_hidden_dim=8, projection_dim=4,
                   head_batch_norm=False, optimizer="sgd", lr=0.1, lr_scaling="none",
                   warmup_epochs=0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 1


@pytest.mark.parametrize(("preset", "crop"), [("cifar", 32), ("imagenet", 224)])
def test_linear_eval_transform_takes_any_size(preset: str, crop: int) -> None:
    for size in SIZES:
        (view,) = LinearEvalTransform(preset)(Image.new("RGB", size, (9, 99, 199)))
        assert view.shape == (3, crop, crop)


@pytest.mark.parametrize(("size", "preset", "message"), [
    ((300, 200), "cifar", r"median shorter side of 200 px \(6 files read\), but the training "
                          r"views are 32 px: each view shows a small part"),
    ((20, 30), "imagenet", r"median shorter side of 20 px .* views are 224 px: every view is "
                           r"an upsampled"),
])
def test_images_far_from_the_crop_size_warn(tmp_path: Path, size, preset, message) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for k in range(6):
        Image.new("RGB", size, (k, 0, 0)).save(folder / f"{k}.png")
    with pytest.warns(UserWarning, match=message):
        ImageFolderDataModule(str(folder), preset=preset, batch_size=2).setup("fit")
