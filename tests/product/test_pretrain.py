"""``ssl_lightning.pretrain``: one call from a folder of images to a trained module, through
the shipped config of the method and the real CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import ssl_lightning
from ssl_lightning.cli.pretrain import backbone_spec, method_config, preset_for

#: One CPU step of training, one validation batch: just enough to produce a checkpoint.
SHORT = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
         "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1",
         "--trainer.check_val_every_n_epoch", "1", "--trainer.num_sanity_val_steps", "0",
         "--data.num_workers", "0", "--data.knn_train_subset", "8"]


def _flat_folder(root: Path, sides: list[int]) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i, side in enumerate(sides):
        pixels = rng.integers(0, 256, (side, side + 7 * (i % 3), 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i:02d}.jpg")
    return root


def test_flat_folder_of_mixed_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    photos = _flat_folder(tmp_path / "photos", [20, 28, 31, 40, 48, 60, 90, 120])
    result = ssl_lightning.pretrain(data=photos, method="SimCLR", backbone="resnet18",
                                    out=tmp_path / "runs" / "x", epochs=1, batch_size=4,
                                    devices=1, overrides=SHORT)
    assert type(result.module).__name__ == "SimCLR"
    assert type(result.module.backbone).__name__ == "ResNet"
    spec = ssl_lightning.backbones.spec.backbone_spec(result.module.backbone)
    assert spec is not None and spec["init_args"]["cifar_stem"]  # median side 44 px: cifar
    assert result.run_dir == tmp_path / "runs" / "x" / "version_0"
    assert result.last_checkpoint == result.run_dir / "checkpoints" / "last.ckpt"
    assert result.last_checkpoint.is_file()
    exported = list((result.run_dir / "export").rglob("*"))
    assert result.exported_backbone == (max(exported, key=lambda p: p.stat().st_size)
                                        if exported else None)


def test_large_images_get_the_imagenet_preset(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    photos = _flat_folder(tmp_path / "photos", [110, 130, 150, 200])
    result = ssl_lightning.pretrain(data=photos, epochs=1, batch_size=4, out="runs/big",
                                    overrides=SHORT)
    data = result.module.trainer.datamodule
    assert data.train_labeled is False and data.val_dir is None
    assert data.device_transform.crop_size == 224  # the config's DeviceViews, imagenet preset
    spec = ssl_lightning.backbones.spec.backbone_spec(result.module.backbone)
    assert spec is not None and spec["init_args"]["cifar_stem"] is False


def test_train_test_folder_evaluates_on_test(tmp_path: Path, tiny_image_folder: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    small = ["--model.backbone", '{"class_path": "SmallConvNet"}']
    result = ssl_lightning.pretrain(data=str(tiny_image_folder), method="byol", epochs=1,
                                    batch_size=4, out="runs/byol", overrides=SHORT + small)
    data = result.module.trainer.datamodule
    assert type(data).__name__ == "ImageFolderDataModule"
    assert (data.train_dir, data.val_dir) == (tiny_image_folder / "train",
                                              tiny_image_folder / "test")
    assert type(data.train_transform).__name__ == "BYOLViews"  # the method's views, cifar preset
    assert tuple(data.train_transform(Image.new("RGB", (32, 32)))[0].shape) == (3, 32, 32)
    assert "val/knn_top1" in result.module.trainer.callback_metrics
    assert result.run_dir == Path("runs/byol/version_0") and result.last_checkpoint.is_file()


def test_preset_backbone_and_method_choices(tmp_path: Path) -> None:
    assert preset_for(_flat_folder(tmp_path / "small", [32, 32, 64])) == "cifar"
    assert preset_for(_flat_folder(tmp_path / "large", [40, 112, 300])) == "imagenet"
    # 91 px photos: 224 px views would upsample them (the image-size check warns), 32 px do not
    assert preset_for(_flat_folder(tmp_path / "medium", [60, 91, 111])) == "cifar"
    assert backbone_spec("resnet50", "imagenet") == {
        "class_path": "ssl_lightning.ResNet", "init_args": {"depth": 50, "cifar_stem": False}}
    assert backbone_spec("mobilenet_v3_small", "cifar")["class_path"] == (
        "ssl_lightning.TorchvisionBackbone")
    assert backbone_spec("vit_small_patch16_224", "imagenet")["class_path"] == (
        "ssl_lightning.TimmBackbone")
    assert method_config("MoCo-V3").name == "moco_v3.yaml"
    with pytest.raises(ValueError, match=r"Unknown method 'simclar': choose one of .*simclr"):
        method_config("simclar")
    with pytest.raises(ValueError, match="Unknown method 'linear'"):
        method_config("linear")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No readable images found under"):
        preset_for(tmp_path / "empty")


def test_a_vit_backbone_follows_the_methods_crops(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A timm ViT is built for the preset's crop size (32 px), not its default 160, and takes
    DINO's 16 px local crops (dynamic_img_size); ``vit_tiny`` is our ViT for those crops."""
    pytest.importorskip("timm")
    monkeypatch.chdir(tmp_path)
    photos = _flat_folder(tmp_path / "photos", [40, 48, 60, 90])  # median 54 px: cifar preset
    small_head = ["--model.head_out_dim", "32", "--model.head_hidden_dim", "32",
                  "--model.head_bottleneck_dim", "16",
                  "--data.train_transform.init_args.num_local_crops", "2"]
    result = ssl_lightning.pretrain(data=photos, method="dino", backbone="test_vit",
                                    epochs=1, batch_size=4, out="runs/vit",
                                    overrides=SHORT + small_head)
    assert result.module.trainer.global_step == 1
    net = result.module.backbone.net
    assert tuple(net.patch_embed.img_size) == (32, 32) and net.dynamic_img_size
    assert backbone_spec("vit_tiny_patch16_224", "imagenet")["init_args"] == {
        "name": "vit_tiny_patch16_224", "model_kwargs": {"img_size": 224}}
    assert backbone_spec("convnext_atto", "cifar")["init_args"] == {"name": "convnext_atto"}
    for preset, size, patch in [("cifar", 32, 4), ("imagenet", 224, 16)]:
        assert backbone_spec("vit_tiny", preset) == {
            "class_path": "ssl_lightning.ViT",
            "init_args": {"arch": "tiny", "image_size": size, "patch_size": patch}}


@pytest.mark.parametrize("epochs", [0, -1, 1.5, True])
def test_epochs_below_one_are_refused_before_anything_runs(tmp_path: Path, epochs: object) -> None:
    """epochs=0 used to export the untrained backbone as the result, -1 to crash."""
    with pytest.raises(ValueError, match=rf"epochs must be a whole number >= 1 .*got "
                                         rf"{epochs!r}; None keeps the method's config "
                                         r"\(simclr.yaml\)"):
        ssl_lightning.pretrain(data=tmp_path / "missing", epochs=epochs)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", [None, 3, ""])
def test_a_method_that_is_no_name_is_refused_with_the_choices(tmp_path: Path,
                                                              method: object) -> None:
    with pytest.raises(ValueError, match=rf"Unknown method {method!r}: choose one of .*simclr"):
        ssl_lightning.pretrain(data=tmp_path, method=method)  # type: ignore[arg-type]
