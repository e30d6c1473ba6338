"""A checkpoint records how its backbone was fed, and ``embed`` uses that by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dense_utils import make_depth_folder, make_segmentation_folder
from evaluation_helpers import tiny_trainer
from PIL import Image

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data import (
    EvalTransform,
    ImageFolderDataModule,
    LinearEvalTransform,
    SimCLRViews,
)
from ssl_lightning.data.dense_pairs import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DepthDataModule,
    SegmentationDataModule,
)
from ssl_lightning.data.preprocessing import PreprocessingWarning
from ssl_lightning.evaluation import KNNEval, LinearEval
from ssl_lightning.evaluation.dense import DenseKNNSegmentation, DepthLinearProbe, SegLinearProbe
from ssl_lightning.evaluation.embed import embed_folder
from ssl_lightning.methods import SimCLR


@pytest.fixture(scope="module")
def trained_at_64(tmp_path_factory, make_image_folder):
    """A SimCLR checkpoint pre-trained (2 steps) on 64 px views of 64 px images, its data
    module evaluating at 64 px too, and the folder of images."""
    root = tmp_path_factory.mktemp("record")
    folder = make_image_folder(root / "images", classes=2, per_class=4, size=64)
    data = ImageFolderDataModule(
        str(folder), preset="cifar", train_transform=SimCLRViews("cifar", crop_size=64),
        eval_transform=EvalTransform("cifar", crop_size=64, resize_size=64), batch_size=4,
        num_workers=0, persistent_workers=False, pin_memory=False)
    model = SimCLR(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                   optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
    trainer = tiny_trainer(max_steps=2)
    trainer.fit(model, datamodule=data)
    ckpt = str(root / "last.ckpt")
    trainer.save_checkpoint(ckpt)
    return ckpt, folder, model.backbone.eval()


def _by_hand(backbone: torch.nn.Module, folder: Path, transform: EvalTransform) -> np.ndarray:
    paths = sorted(folder.rglob("*.jpg"))
    with torch.no_grad():
        images = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
        return backbone(images).numpy()


def test_the_checkpoint_records_its_preprocessing_as_plain_data(trained_at_64):
    ckpt, _, _ = trained_at_64
    record = torch.load(ckpt, weights_only=True)["preprocessing"]
    assert record == {
        "preset": "cifar", "image_reader": "rgb", "crop_size": 64, "resize_size": 64,
        "interpolation": "bilinear", "channels": 3, "mean": [0.4914, 0.4822, 0.4465],
        "std": [0.247, 0.2435, 0.2616],
        "normalization": "x / 255, then (x - mean) / std per channel"}


def test_embed_uses_the_checkpoints_64_px_by_default(trained_at_64, tmp_path, capsys):
    ckpt, folder, backbone = trained_at_64
    result = embed_folder(ckpt, str(folder), str(tmp_path / "emb.npy"), batch_size=3)
    assert result["rows"] == 8
    at_64 = _by_hand(backbone, folder, EvalTransform("cifar", crop_size=64, resize_size=64))
    at_32 = _by_hand(backbone, folder, EvalTransform("cifar"))
    embedded = np.load(tmp_path / "emb.npy")
    np.testing.assert_allclose(embedded, at_64, rtol=0, atol=1e-6)
    assert np.abs(embedded - at_32).max() > 1e-3  # the old default (32 px) is another input
    assert "embed: preprocessing the checkpoint's: rgb images" in capsys.readouterr().out


def test_an_override_the_backbone_was_not_trained_on_warns(trained_at_64, tmp_path):
    ckpt, folder, backbone = trained_at_64
    with pytest.warns(PreprocessingWarning, match="--crop-size 32 overrides the checkpoint's "
                                                  "crop_size 64"):
        embed_folder(ckpt, str(folder), str(tmp_path / "emb.npy"), crop_size=32)
    np.testing.assert_allclose(np.load(tmp_path / "emb.npy"),
                               _by_hand(backbone, folder, EvalTransform("cifar", crop_size=32,
                                                                        resize_size=32)),
                               rtol=0, atol=1e-6)


def test_a_checkpoint_without_a_record_warns_that_the_preprocessing_is_a_guess(
        trained_at_64, tmp_path):
    ckpt, folder, _ = trained_at_64
    old = torch.load(ckpt, weights_only=True)
    del old["preprocessing"]
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.warns(PreprocessingWarning, match="preprocessing is a guess: preset cifar, "
                                                  "image_reader rgb. Set it with --preset"):
        result = embed_folder(str(tmp_path / "old.ckpt"), str(folder), str(tmp_path / "e.npy"))
    assert result["rows"] == 8


def _data(folder: Path, **kwargs) -> ImageFolderDataModule:
    return ImageFolderDataModule(str(folder), val_dir=str(folder), preset="cifar", batch_size=4,
                                 num_workers=0, persistent_workers=False, pin_memory=False,
                                 **kwargs)


def test_knn_eval_evaluates_with_the_checkpoints_preprocessing_by_default(trained_at_64,
                                                                          capsys):
    ckpt, folder, _ = trained_at_64
    data = _data(folder)  # no eval_transform: the preset's 32 px unless the checkpoint says
    tiny_trainer().validate(KNNEval(checkpoint=ckpt, k=2), datamodule=data)
    assert data.eval_transform.settings["crop_size"] == 64
    assert data.eval_datasets[1][0][0].shape == (3, 64, 64)
    assert "KNNEval: preprocessing of the data module: rgb images (3 channels, preset cifar), " \
           "resize 64, centre crop 64" in capsys.readouterr().out


def test_knn_eval_warns_when_the_data_is_fed_otherwise_than_the_checkpoint(trained_at_64):
    ckpt, folder, _ = trained_at_64
    data = _data(folder, eval_transform=EvalTransform("cifar"))  # given: kept, with a warning
    with pytest.warns(PreprocessingWarning, match="differs from the checkpoint's record in "
                                                  "crop_size, resize_size"):
        tiny_trainer().validate(KNNEval(checkpoint=ckpt, k=2), datamodule=data)
    assert data.eval_transform.settings["crop_size"] == 32


def test_linear_eval_warns_when_its_training_views_are_not_the_checkpoints_size(
        trained_at_64):
    ckpt, folder, _ = trained_at_64
    data = _data(folder, train_transform=LinearEvalTransform("cifar"))  # 32 px crops
    with pytest.warns(PreprocessingWarning, match="trains on 32x32 px views, but the "
                                                  "checkpoint's backbone was fed 64 px crops"):
        tiny_trainer().validate(LinearEval(num_classes=2, checkpoint=ckpt), datamodule=data)


def test_linear_eval_trains_on_the_checkpoints_crop_and_statistics_by_default(trained_at_64,
                                                                              capsys):
    """No train_transform given: LinearEval's views are the recorded 64 px crops (the preset's
    32 px before), with the recorded mean and std, and it says so."""
    ckpt, folder, _ = trained_at_64
    data = _data(folder)
    tiny_trainer(max_steps=1).fit(LinearEval(num_classes=2, checkpoint=ckpt), datamodule=data)
    assert isinstance(data.train_transform, LinearEvalTransform)
    (view,), _ = data.train_dataset[0][:2]
    assert view.shape == (3, 64, 64)
    assert ("LinearEval: training views from the checkpoint's preprocessing: random crop "
            "(4 px padding) 64 px + horizontal flip, mean [0.4914, 0.4822, 0.4465], "
            "std [0.247, 0.2435, 0.2616]") in capsys.readouterr().out


CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.247, 0.2435, 0.2616]  # the record's


@pytest.fixture(scope="module")
def dense_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dense")
    make_segmentation_folder(root / "seg", train=4, val=2)
    make_depth_folder(root / "depth", train=4, val=2)
    return root


def _dense(kind: str, root: Path, **kwargs):
    tiny = {"crop_size": 32, "batch_size": 4, "num_workers": 0, "eval_size": None, **kwargs}
    if kind == "depth":
        return DepthDataModule(str(root / "depth"), bank_images=0, **tiny)
    return SegmentationDataModule(str(root / "seg"), num_classes=3,
                                  bank_images=None if kind == "knn" else 0, **tiny)


def _probe(kind: str, ckpt: str):
    if kind == "seg":
        return SegLinearProbe(num_classes=3, checkpoint=ckpt, lrs=[1e-2], image_size=32)
    if kind == "depth":
        return DepthLinearProbe(checkpoint=ckpt, lrs=[1e-2], num_bins=4, image_size=32)
    return DenseKNNSegmentation(num_classes=3, checkpoint=ckpt, ks=[1])


@pytest.mark.parametrize("kind", ["seg", "depth", "knn"])
def test_dense_probes_normalise_by_the_checkpoints_statistics_by_default(
        trained_at_64, dense_root, kind, capsys):
    """No --data.mean / --data.std: every loader of the dense data normalises by the
    checkpoint's recorded statistics (ImageNet's before), and the probe says so."""
    ckpt, _, _ = trained_at_64
    data = _dense(kind, dense_root)
    probe = _probe(kind, ckpt)
    tiny_trainer().validate(probe, datamodule=data)
    for transform in (data.train_transform, data.eval_transform, data.bank_transform):
        np.testing.assert_allclose(transform.mean.flatten(), CIFAR_MEAN, rtol=0, atol=1e-7)
        np.testing.assert_allclose(transform.std.flatten(), CIFAR_STD, rtol=0, atol=1e-7)
    image, _ = data.val_dataloader()[-1].dataset[0]
    assert abs(float(image.mean())) < 10  # normalised, not raw
    out = capsys.readouterr().out
    assert (f"{type(probe).__name__}: normalisation from the checkpoint's: mean {CIFAR_MEAN}, "
            f"std {CIFAR_STD}, rgb images; crop 32 px and val shorter side None px are the "
            "protocol's") in out


def test_a_dense_probe_keeps_given_statistics_and_warns_that_they_differ(trained_at_64,
                                                                        dense_root):
    ckpt, _, _ = trained_at_64
    data = _dense("seg", dense_root, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    with pytest.warns(PreprocessingWarning, match="--data.mean and --data.std override the "
                                                  "checkpoint's: the backbone was trained on "
                                                  "mean \\[0.4914"):
        tiny_trainer().validate(_probe("seg", ckpt), datamodule=data)
    np.testing.assert_allclose(data.eval_transform.mean.flatten(), IMAGENET_MEAN, atol=1e-7)
