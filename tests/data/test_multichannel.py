"""Images of any channel count and bit depth: read without loss (16-bit, 13 bands), per-channel
statistics, views, backbones with ``in_chans``, and a pre-training run through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from ssl_lightning.backbones import ResNet, SmallConvNet, TimmBackbone, TorchvisionBackbone, ViT
from ssl_lightning.cli import main
from ssl_lightning.cli.channel_stats import main as channel_stats_main
from ssl_lightning.data import (
    ArrayImage,
    DeviceViews,
    ImageFolderDataModule,
    MultiChannelDeviceViews,
    MultiChannelEval,
    MultiChannelViews,
)
from ssl_lightning.data.arrays import load_array
from ssl_lightning.data.channel_stats import channel_statistics
from ssl_lightning.data.datasets import CorruptImageError, ImageFolderDataset
from ssl_lightning.data.indexing import ARRAY_EXTENSIONS
from ssl_lightning.data.multichannel_views import ChannelNormalize
from ssl_lightning.evaluation.embed import main as embed_main

ROOT = Path(__file__).resolve().parents[2]


def bands(seed: int, channels: int = 13, size: int = 16, high: int = 65536) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, (channels, size, size), dtype=np.uint16)


def test_a_16_bit_tiff_and_png_keep_their_full_range(tmp_path: Path) -> None:
    pixels = bands(0, channels=1)[0]
    pixels[0, 0], pixels[0, 1] = 0, 65535
    tifffile.imwrite(tmp_path / "a.tif", pixels)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    for name in ("a.tif", "a.png"):
        image = load_array(tmp_path / name)
        assert image.dtype == torch.float32 and image.shape == (1, 16, 16)
        assert torch.equal(image[0], torch.from_numpy(pixels.astype(np.float32))), name


def test_13_band_images_read_as_c_h_w_equal_to_the_source(tmp_path: Path) -> None:
    source = bands(1)
    tifffile.imwrite(tmp_path / "planar.tif", source, photometric="minisblack")  # C, Y, X
    tifffile.imwrite(tmp_path / "contig.tif", np.moveaxis(source, 0, -1),
                     photometric="minisblack", planarconfig="contig")  # Y, X, S
    np.save(tmp_path / "array.npy", source.astype(np.float32) / 7.0)
    expected = torch.from_numpy(source.astype(np.float32))
    assert torch.equal(load_array(tmp_path / "planar.tif"), expected)
    assert torch.equal(load_array(tmp_path / "contig.tif"), expected)
    assert torch.equal(load_array(tmp_path / "array.npy"), expected / 7.0)
    (tmp_path / "bad.tif").write_bytes(b"II*\0 not a tiff")
    with pytest.raises(CorruptImageError, match="bad.tif"):
        load_array(tmp_path / "bad.tif")


def test_channel_statistics_equal_a_float64_reference(tmp_path: Path) -> None:
    images = [bands(seed, channels=4, high=200).astype(np.float64) + [[[60000.0]], [[0.0]],
                                                                    [[1.0]], [[30000.0]]]
              for seed in range(3)]
    for i, image in enumerate(images):
        np.save(tmp_path / f"{i}.npy", image.astype(np.float32))
    mean, std, count = channel_statistics(sorted(tmp_path.glob("*.npy")))
    stacked = np.concatenate([image.reshape(4, -1) for image in images], axis=1)
    assert count == 3
    np.testing.assert_allclose(mean, stacked.mean(1), rtol=1e-12)
    np.testing.assert_allclose(std, stacked.std(1), rtol=1e-9)  # 60000 ± 100: no cancellation
    np.save(tmp_path / "9.npy", np.zeros((3, 4, 4), np.float32))
    with pytest.raises(ValueError, match="3 channels, the images before it 4"):
        channel_statistics(sorted(tmp_path.glob("*.npy")))


def test_the_channel_stats_command_prints_yaml(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    for i in range(3):
        tifffile.imwrite(tmp_path / f"{i}.tif", bands(i, channels=2), photometric="minisblack")
    mean, std, count = channel_stats_main(["--images", str(tmp_path), "--limit", "2"])
    out = capsys.readouterr().out
    assert count == 2 and f"mean: [{mean[0]:.6g}, {mean[1]:.6g}]" in out and "std: [" in out


def test_multichannel_views_normalise_per_channel() -> None:
    image = torch.from_numpy(bands(2, channels=13).astype(np.float32))
    mean, std = [float(m) for m in image.mean((1, 2))], [float(s) for s in image.std((1, 2))]
    evaluated = MultiChannelEval(mean, std, crop_size=16)(image)
    expected = (image - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
    torch.testing.assert_close(evaluated, expected, rtol=0, atol=1e-6)
    views = MultiChannelViews(mean, std, crop_size=8)(image)
    assert len(views) == 2 and all(v.shape == (13, 8, 8) for v in views)
    with pytest.raises(ValueError, match="13 channels but mean/std give 3"):
        MultiChannelEval([0.0] * 3, [1.0] * 3, crop_size=16)(image)


@pytest.mark.parametrize("backbone", [
    lambda: SmallConvNet(widths=(8,), in_chans=13),
    lambda: ResNet(depth=18, cifar_stem=True, in_chans=13),
    lambda: TorchvisionBackbone("mobilenet_v3_small", in_chans=13),
    lambda: ViT(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, in_chans=13),
    lambda: TimmBackbone("resnet10t", model_kwargs={"in_chans": 13}),
])
def test_backbones_read_any_channel_count(backbone) -> None:
    net = backbone().eval()
    assert net(torch.randn(2, 13, 16, 16)).shape[0] == 2
    with pytest.raises(RuntimeError):
        net(torch.randn(2, 3, 16, 16))


def test_array_images_need_the_multichannel_transforms(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing: train_transform; missing: eval_transform"):
        ImageFolderDataModule(str(tmp_path), image_reader="array")
    evaluation = MultiChannelEval([0.0] * 13, [1.0] * 13, crop_size=8)
    with pytest.raises(ValueError, match="got device_transform: DeviceViews"):
        ImageFolderDataModule(str(tmp_path), image_reader="array", eval_transform=evaluation,
                              device_transform=DeviceViews())
    batched = MultiChannelDeviceViews([0.0] * 13, [1.0] * 13, crop_size=8)
    with pytest.raises(ValueError, match="set image_reader: array"):
        ImageFolderDataModule(str(tmp_path), device_transform=batched)
    module = ImageFolderDataModule(str(tmp_path), image_reader="array",
                                   eval_transform=evaluation, device_transform=batched)
    assert isinstance(module.train_transform, ArrayImage)
    with pytest.raises(ValueError, match=r"float \(B, 13, H, W\) images"):
        batched(torch.zeros(2, 3, 16, 16))


def _reference_view(x: torch.Tensor, box: list[float], flip: bool, brightness: float,
                    contrast: float, sigma: float, kernel: int, mean: torch.Tensor,
                    std: torch.Tensor, size: int) -> torch.Tensor:
    """One view by torchvision's per-image functions and MultiChannelViews' formulas."""
    x0, y0, x1, y1 = (int(v) for v in box)
    view = TF.resized_crop(x, y0, x0, y1 - y0, x1 - x0, [size, size], antialias=True)
    view = TF.horizontal_flip(view) if flip else view
    channel_mean = view.mean((1, 2), keepdim=True)  # RandomIntensity: contrast around the mean
    view = ((view - channel_mean) * contrast + channel_mean) * brightness
    view = TF.gaussian_blur(view, [kernel, kernel], [sigma, sigma]) if sigma > 0 else view
    return (view - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)


def test_batched_multichannel_views_equal_the_per_image_recipe() -> None:
    """Every batched 13-band view (16-bit range, float64) equals the per-image recipe applied
    with its drawn parameters, and a sample's views depend only on its seed."""
    images = torch.from_numpy(np.stack([bands(s) for s in range(6)]).astype(np.float64))
    mean = images.mean((0, 2, 3)).tolist()
    std = images.std((0, 2, 3)).tolist()
    views = MultiChannelDeviceViews(mean, std, crop_size=12, crop_scale=(0.3, 1.0),
                                    intensity_p=0.5, blur_p=0.5)
    seeds = torch.arange(100, 106)
    views._keys, views._counter = seeds, 0  # the draws of one view, keyed as __call__ does
    params = views.draw_params(6, 16, 16, "cpu")
    views._keys = None
    assert params.intensity.any() and not params.intensity.all()
    assert (params.blur_sigma > 0).any() and (params.blur_sigma == 0).any()
    out = views.apply(images, params)
    mean_t, std_t = views.normalize.mean.double(), views.normalize.std.double()  # float32 stats
    for i in range(6):
        expected = _reference_view(
            images[i], params.boxes[i].tolist(), bool(params.flip[i]),
            float(params.brightness[i]), float(params.contrast[i]),
            float(params.blur_sigma[i]), views.blur_kernel, mean_t, std_t, 12)
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-9)
    whole = views(images, seeds=seeds)
    halves = [views(images[part], seeds=seeds[part]) for part in (slice(0, 3), slice(3, 6))]
    for v in range(2):
        torch.testing.assert_close(torch.cat([h[v] for h in halves]), whole[v], rtol=0, atol=0)


def test_array_image_resizes_the_centre_square_in_the_files_units() -> None:
    image = torch.from_numpy(bands(3, size=20).astype(np.float32))[:, :, 2:18]  # 20 x 16
    decoded, = ArrayImage(8)(image)
    expected = torch.nn.functional.interpolate(image[None, :, 2:18], size=(8, 8), mode="bilinear",
                                               antialias=True)[0]
    torch.testing.assert_close(decoded, expected, rtol=0, atol=0)
    assert decoded.max() > 255 and ArrayImage()(image)[0] is image


def test_the_array_reader_lists_npy_files_and_the_rgb_reader_does_not(tmp_path: Path) -> None:
    for c in range(2):
        (tmp_path / f"class_{c}").mkdir()
        np.save(tmp_path / f"class_{c}" / "a.npy", bands(c, channels=4))
        Image.new("RGB", (8, 8)).save(tmp_path / f"class_{c}" / "b.png")
    arrays = ImageFolderDataset(tmp_path, loader=load_array, extensions=ARRAY_EXTENSIONS)
    assert [Path(p).name for p, _ in arrays.samples] == ["a.npy", "b.png"] * 2
    assert [Path(p).name for p, _ in ImageFolderDataset(tmp_path).samples] == ["b.png"] * 2
    image, label = arrays[2]
    assert label == 1 and torch.equal(image, torch.from_numpy(bands(1, channels=4).astype(
        np.float32)))


@pytest.mark.parametrize("batched", [False, True], ids=["per-image", "batched"])
def test_pretraining_on_13_band_tiffs_through_the_cli(tmp_path: Path, batched: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for split, per_class in (("train", 6), ("test", 4)):
        for c in range(2):
            folder = tmp_path / "data" / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                tifffile.imwrite(folder / f"{i}.tif", bands(100 * c + i) // (c + 1),
                                 photometric="minisblack")
    monkeypatch.chdir(tmp_path)
    stats = {"mean": [30000.0] * 13, "std": [18000.0] * 13, "crop_size": 16}
    views = json.dumps({"class_path": "MultiChannelViews", "init_args": stats})
    evaluation = json.dumps({"class_path": "MultiChannelEval", "init_args": stats})
    batched_views = json.dumps({"class_path": "MultiChannelDeviceViews", "init_args": stats})
    cli = main([
        "fit", "--config", str(ROOT / "configs" / "simclr.yaml"),
        "--model.backbone", '{"class_path": "ssl_lightning.SmallConvNet", "init_args": '
                            '{"widths": [8, 16], "in_chans": 13}}',
        "--model.projection_hidden_dim", "16", "--model.projection_dim", "8",
        "--data", "ImageFolderDataModule", "--data.train_dir", "data/train",
        "--data.val_dir", "data/test", "--data.image_reader", "array",
        *(["--data.device_transform", batched_views] if batched else
          ["--data.train_transform", views, "--data.device_transform", "null"]),
        "--data.eval_transform", evaluation, "--data.batch_size", "4", "--data.num_workers", "0",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.limit_train_batches", "2", "--trainer.check_val_every_n_epoch", "1",
        "--trainer.max_epochs", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.precision", "32-true", "--trainer.callbacks.init_args.enabled", "false",
    ])
    assert cli.trainer.global_step == 2
    assert 0 <= cli.trainer.callback_metrics["val/knn_top1"] <= 100
    if batched:  # embed the 13-band test images with the run's backbone
        checkpoint = next(Path("runs").rglob("last.ckpt"))
        record = torch.load(checkpoint, weights_only=True)["preprocessing"]
        assert (record["image_reader"], record["channels"], record["crop_size"]) == (
            "array", 13, 16)
        assert record["mean"] == stats["mean"] and record["std"] == stats["std"]
        # the reader, the crop and the 13 channel statistics come from the checkpoint
        result = embed_main(["--checkpoint", str(checkpoint), "--images", "data/test",
                             "--output", "emb.npy"])
        assert result["rows"] == 8 and np.load("emb.npy").shape == (8, 16)


@pytest.mark.parametrize(("mean", "std"), [([0.0, float("nan")], [1.0, 1.0]),
                                           ([0.0, 0.0], [1.0, float("inf")]),
                                           ([0.0, 0.0], [1.0, float("nan")]),
                                           ([0.0, 0.0], [1.0, 0.0]), ([0.0, 0.0], [1.0, -2.0])])
def test_non_finite_or_non_positive_statistics_are_refused_when_constructed(
        mean: list[float], std: list[float]) -> None:
    """NaN statistics used to turn every input into NaN without a word."""
    with pytest.raises(ValueError, match="one finite value per channel each .* std > 0"):
        ChannelNormalize(mean, std)
    with pytest.raises(ValueError, match="one finite value per channel"):
        MultiChannelViews(mean, std, crop_size=8)
