"""A run made to diverge on purpose is captured and its step replayed exactly
(``DivergenceCapture`` + ``python -m ssl_lightning replay``, docs/reliability.md).

Tiny SimCLR runs through the real CLI (24 images of 32 px, batch 4, CPU): a learning rate that
overflows the weights at a known step, a poisoned image whose views are NaN, a loss spike
(``spike_factor``) for a capture with a finite loss and its gradients, and the known-bad
variant: views drawn from a generator the sample seeds do not drive, which the replay check
must catch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml
from PIL import Image

from ssl_lightning.cli import main
from ssl_lightning.cli.replay import replay
from ssl_lightning.data.transforms import SimCLRViews
from ssl_lightning.io import capture as files

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  logger: false
  enable_checkpointing: false
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
model:
  class_path: SimCLR
  init_args:
    backbone:
      class_path: SmallConvNet
      init_args: {widths: [8, 16]}
    projection_hidden_dim: 16
    projection_dim: 8
    optimizer: sgd
    lr: 0.1
    lr_scaling: none
    warmup_epochs: 0
data:
  class_path: ImageFolderDataModule
  init_args: {batch_size: 4, num_workers: 0, preset: cifar}
"""

MAGENTA = (255, 0, 255)


class LrOverflow(pl.Callback):
    """Sets the learning rate to ``lr`` for the update of global step ``step``."""

    def __init__(self, step: int = 2, lr: float = 1e12) -> None:
        self.step, self.lr = step, lr

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            for group in optimizer.param_groups:
                group["lr"] = self.lr


class PoisonedViews(SimCLRViews):
    """SimCLR views, NaN for a magenta image (a decoder gone wrong on one file)."""

    def __call__(self, image):
        views = super().__call__(image)
        if image.convert("RGB").getpixel((0, 0)) == MAGENTA:
            views = [torch.full_like(v, math.nan) for v in views]
        return views


class NumpyNoiseViews(SimCLRViews):
    """Known-bad: noise from NumPy's global generator, which the sample seeds do not drive."""

    def __call__(self, image):
        return [v + torch.from_numpy(np.random.rand(*v.shape)).float() for v in
                super().__call__(image)]


def fit_until_diverged(root: Path, images: Path, *, callbacks=(), transform: str | None = None,
                       capture_args: dict | None = None, capsys=None) -> Path:
    """Run the CLI in ``root`` until it stops on divergence; the capture folder."""
    config = yaml.safe_load(CONFIG)
    config["data"]["init_args"]["train_dir"] = str(images)
    if transform is not None:
        config["data"]["init_args"]["train_transform"] = {
            "class_path": f"{__name__}.{transform}", "init_args": {"preset": "cifar"}}
    config["trainer"]["callbacks"] = [{"class_path": f"{__name__}.{c}"} for c in callbacks]
    if capture_args is not None:
        config["trainer"]["callbacks"].append(
            {"class_path": "DivergenceCapture", "init_args": capture_args})
    root.mkdir(parents=True, exist_ok=True)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        with pytest.raises(SystemExit) as stopped:
            main(["fit", "--config", str(path)])
    assert stopped.value.code == 1
    captures = sorted((root / files.CAPTURES_DIR).glob("step-*"))
    assert len(captures) == 1, captures
    return captures[0]


@pytest.fixture(scope="module")
def overflow(tmp_path_factory, tiny_image_folder):
    return fit_until_diverged(tmp_path_factory.mktemp("overflow"), tiny_image_folder / "train",
                              callbacks=["LrOverflow"])


def test_lr_overflow_is_captured_before_the_step(overflow) -> None:
    manifest = json.loads((overflow / files.MANIFEST).read_text())
    assert manifest["step"] == {"epoch": 0, "batch": 3, "global_step": 3}
    assert "loss is nan" in manifest["reason"] or "loss is inf" in manifest["reason"]
    for name in manifest["files"]:
        path = overflow / name
        if name.endswith(".json"):
            json.loads(path.read_text())
        elif name.endswith((".pt", ".ckpt")):
            torch.load(path, weights_only=True)
    rank = json.loads((overflow / "rank-0.json").read_text())
    assert len(rank["sample_seeds"]) == len(rank["dataset_indices"]) == 4
    assert not list(overflow.parent.glob(".*.tmp"))


def test_lr_overflow_replays_bit_exactly_and_names_the_module(overflow, capsys) -> None:
    report = replay(overflow)
    print(report.text())
    assert report.same_samples and report.loss_equal
    assert report.reproduced
    assert report.first_nonfinite_output is not None
    assert False, report.text()
