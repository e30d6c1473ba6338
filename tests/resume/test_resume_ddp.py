"""A 2-process (gloo, DDP) SimCLR run on the real image-folder
data module with random augmentations, resumed from a checkpoint inside epoch 1, equals the
uninterrupted 2-process run; resuming that checkpoint on 1 process stops with an error that
names both data layouts."""

from __future__ import annotations

import os

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data import ImageFolderDataModule, SimCLRViews
from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import assert_states_close, fit_and_dump

pytestmark = pytest.mark.slow


def _model() -> SimCLR:
    torch.manual_seed(0)
    return SimCLR(SmallConvNet((4, 8), norm="group"), projection_hidden_dim=8, projection_dim=4,
                  optimizer="sgd", lr=0.3, lr_scaling="none", warmup_epochs=0.5, image_size=16)


def _data(root) -> ImageFolderDataModule:  # type: ignore[no-untyped-def]
    return ImageFolderDataModule(str(root / "train"), preset="cifar", batch_size=2, num_workers=0,
                                 seed=3, train_transform=SimCLRViews("cifar", crop_size=16))


def test_ddp_resume_inside_epoch_equals_uninterrupted_run(tmp_path, tiny_image_folder) -> None:
    ckpts = tmp_path / "ckpts"
    every_step = ModelCheckpoint(ckpts, filename="{step}", save_top_k=-1, every_n_train_steps=4)
    straight = fit_and_dump(_model(), _data(tiny_image_folder), devices=2, max_epochs=2,
                            enable_checkpointing=True, callbacks=[every_step])
    assert straight[0]["global_step"] == 12  # 24 images, 2 ranks x 2 per step, 2 epochs
    mid = os.path.join(ckpts, "step=8.ckpt")  # inside epoch 1
    resumed = fit_and_dump(_model(), _data(tiny_image_folder), devices=2, max_epochs=2,
                           ckpt_path=mid)
    for rank in (0, 1):
        for part in ("model", "optimizer", "scheduler"):
            assert_states_close(resumed[rank][part], straight[rank][part], atol=0.0, path=part)

    with pytest.raises(ValueError, match=r"'num_replicas': 2.*'num_replicas': 1.*end of an epoch"):
        fit_and_dump(_model(), _data(tiny_image_folder), devices=1, max_epochs=2, ckpt_path=mid)
