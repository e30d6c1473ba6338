"""Pre-train on a folder of images in one call: ``ssl_lightning.pretrain(data="photos/")``.

The run is the shipped config of the method (``configs/<method>.yaml``) through
:func:`ssl_lightning.cli.main`, with the data switched to an
:class:`~ssl_lightning.data.ImageFolderDataModule` on the folder, the transforms' preset picked
from the images' size, and the backbone optionally named.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ssl_lightning._lightning import pl
from ssl_lightning.data.checks import image_short_sides
from ssl_lightning.data.datasets import check_directory
from ssl_lightning.data.indexing import find_images
from ssl_lightning.data.transforms import PresetName, get_preset

#: Configs of ``CONFIGS_DIR`` that evaluate a checkpoint instead of pre-training.
EVALUATION_CONFIGS = ("knn", "linear")

#: Crop size and ViT patch size of the ``"imagenet"`` preset.
IMAGENET_CROP, IMAGENET_PATCH = 224, 16
#: Our ViT's patch size under the ``"cifar"`` preset (8x8 tokens on 32 px, as in the configs).
CIFAR_PATCH = 4

#: Images whose median shorter side is below this get the ``"cifar"`` preset (32 px views):
#: half the ``"imagenet"`` crop, below which the image-size check finds its views upsampled.
CIFAR_BELOW_SIDE = IMAGENET_CROP // 2


@dataclass(frozen=True)
class PretrainResult:
    """What :func:`pretrain` produced.

    Attributes:
        module: The trained method (a ``LightningModule``).
        run_dir: The run's log directory (config, logs, ``checkpoints/``).
        last_checkpoint: The last checkpoint written, or None.
        exported_backbone: The backbone file under ``run_dir/export/``, or None when the run
            exported none.
    """

    module: pl.LightningModule
    run_dir: Path
    last_checkpoint: Path | None
    exported_backbone: Path | None


def method_names() -> list[str]:
    """The methods :func:`pretrain` knows: the pre-training configs shipped in ``configs/``."""
    from ssl_lightning.cli.commands import shipped_configs

    return [p.stem for p in shipped_configs() if p.stem not in EVALUATION_CONFIGS]


def method_config(method: str) -> Path:
    """The shipped config of ``method`` (case-insensitive, ``-`` read as ``_``).

    Raises:
        ValueError: no such method (or not a name); the message lists them.
    """
    from ssl_lightning.cli.commands import CONFIGS_DIR

    known = method_names()
    name = method.lower().replace("-", "_") if isinstance(method, str) else None
    if name not in known:
        raise ValueError(f"Unknown method {method!r}: choose one of {', '.join(known)}.")
    return CONFIGS_DIR / f"{name}.yaml"


def data_splits(data: Path) -> tuple[Path, Path | None]:
    """``(train_dir, val_dir)`` of ``data``: its ``train/`` and ``test/`` (or ``val/``)
    sub-folders when both exist, else ``data`` itself (unlabeled) and no validation."""
    check_directory(data, "Give the folder of your images.")
    evaluation = next((data / n for n in ("test", "val") if (data / n).is_dir()), None)
    if (data / "train").is_dir() and evaluation is not None:
        return data / "train", evaluation
    return data, None


def preset_for(folder: Path) -> PresetName:
    """``"cifar"`` when the median shorter side of a sample of ``folder``'s images is below
    :data:`CIFAR_BELOW_SIDE` px, else ``"imagenet"``.

    Raises:
        FileNotFoundError: no readable image under ``folder``.
    """
    sides = image_short_sides(find_images(folder))
    if not sides:
        raise FileNotFoundError(f"No readable images found under {folder}: give a folder of "
                                "images (any tree of .jpg / .png / ... files).")
    return "cifar" if statistics.median(sides) < CIFAR_BELOW_SIDE else "imagenet"


def backbone_spec(name: str, preset: PresetName) -> dict[str, Any]:
    """The config of a backbone named ``"resnet18"`` / ``"resnet34"`` / ``"resnet50"`` (ours,
    with the CIFAR stem under the ``"cifar"`` preset), ``"vit_tiny"`` / ``"vit_small"`` /
    ``"vit_base"`` (our :class:`~ssl_lightning.ViT` for the preset's crops: 4 px patches on
    32 px, 16 px on 224 px), else a torchvision or timm model name (a timm model of one input
    size, such as a ViT, built for the preset's crop size)."""
    import torchvision

    cifar = preset == "cifar"
    crop = get_preset(preset).crop_size
    ours = re.fullmatch(r"resnet(18|34|50)", name)
    if ours:
        return {"class_path": "ssl_lightning.ResNet",
                "init_args": {"depth": int(ours.group(1)), "cifar_stem": cifar}}
    vit = re.fullmatch(r"vit_(tiny|small|base)", name)
    if vit:
        return {"class_path": "ssl_lightning.ViT",
                "init_args": {"arch": vit.group(1), "image_size": crop,
                              "patch_size": CIFAR_PATCH if cifar else IMAGENET_PATCH}}
    if name in torchvision.models.list_models(module=torchvision.models):
        return {"class_path": "ssl_lightning.TorchvisionBackbone",
                "init_args": {"name": name, "cifar_stem": cifar}}
    sized = {"model_kwargs": {"img_size": crop}} if _timm_takes_img_size(name, crop) else {}
    return {"class_path": "ssl_lightning.TimmBackbone", "init_args": {"name": name, **sized}}


def _timm_takes_img_size(name: str, size: int) -> bool:
    """Whether the timm model ``name`` is built for one input size (``img_size``: ViTs and the
    like, whose position embeddings are made for it); tried on the meta device, no weights."""
    import torch

    try:
        import timm
    except ImportError:
        return False  # TimmBackbone says how to install it
    if not timm.is_model(name):
        return False  # TimmBackbone names the unknown model, with close matches
    try:
        with torch.device("meta"):
            timm.create_model(name, pretrained=False, num_classes=0, img_size=size)
    except TypeError:
        return False
    return True


def _with_preset(spec: Any, preset: PresetName) -> Any:
    """A transform's config with its ``preset`` / ``dataset`` argument set to ``preset``."""
    if not isinstance(spec, dict) or not isinstance(spec.get("init_args"), dict):
        return spec
    init_args = {key: preset if key in ("preset", "dataset") else value
                 for key, value in spec["init_args"].items()}
    return {**spec, "init_args": init_args}


def _imagenet_backbone(spec: dict[str, Any]) -> dict[str, Any]:
    """A config's CIFAR backbone resized for 224 px images: no CIFAR stem, ViT patches of 16."""
    init_args = dict(spec.get("init_args") or {})
    if "cifar_stem" in init_args:
        init_args["cifar_stem"] = False
    if "image_size" in init_args:
        init_args.update(image_size=IMAGENET_CROP, patch_size=IMAGENET_PATCH)
    return {**spec, "init_args": init_args}


def _exported(run_dir: Path) -> Path | None:
    files = [p for p in (run_dir / "export").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size) if files else None


def pretrain(
    data: str | Path,
    method: str = "simclr",
    backbone: str | None = None,
    out: str | Path = "runs/pretrain",
    epochs: int | None = None,
    batch_size: int | None = None,
    devices: int | str | None = None,
    overrides: Sequence[str] = (),
) -> PretrainResult:
    """Pre-train ``method`` on the images under ``data`` with the shipped config of the method.

    Example: ``pretrain(data="photos/", method="dino", backbone="resnet18", out="runs/x")``.

    Args:
        data: A folder with ``train/`` and ``test/`` (or ``val/``) sub-folders (labeled
            ``<split>/<class>/<image>``; kNN and probe are evaluated on them), or any folder of
            images (unlabeled, no validation).
        method: A shipped config's name (:func:`method_names`: ``"simclr"``, ``"dino"``,
            ``"moco_v3"``, ...), case-insensitive.
        backbone: ``"resnet18"`` / ``"resnet34"`` / ``"resnet50"`` (ours), or a torchvision or
            timm model name; None keeps the config's (resized for large images).
        out: The run goes to ``out/version_N/``.
        epochs: ``trainer.max_epochs``; None keeps the config's.
        batch_size: Batch size per device; None keeps the config's.
        devices: ``trainer.devices``; None keeps the config's.
        overrides: More command-line arguments, applied last (e.g.
            ``["--trainer.limit_train_batches", "10"]``).

    The transforms' preset follows the images: ``"cifar"`` (32 px views) when the median
    shorter side of a sample of their headers is below :data:`CIFAR_BELOW_SIDE` px (112), else
    ``"imagenet"`` (224 px).

    Raises:
        ValueError: an unknown method, or ``epochs`` that is not a whole number >= 1.
        FileNotFoundError: ``data`` is missing or holds no readable image.
        SystemExit: a setting the CLI refused (its message is on stderr), as
            :func:`ssl_lightning.cli.main`.
    """
    from ssl_lightning.cli import main

    config_path = method_config(method)
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 1):
        raise ValueError(f"epochs must be a whole number >= 1 (trainer.max_epochs), got "
                         f"{epochs!r}; None keeps the method's config ({config_path.name}).")
    config = yaml.safe_load(config_path.read_text())
    train_dir, val_dir = data_splits(Path(data))
    preset = preset_for(train_dir)

    data_args = {key: _with_preset(value, preset)
                 for key, value in ((config.get("data") or {}).get("init_args") or {}).items()
                 if key not in ("root", "download", "archive", "archive_max_mb")}
    data_args.update(train_dir=str(train_dir), val_dir=None if val_dir is None else str(val_dir),
                     preset=preset)
    if val_dir is None:
        data_args["train_labeled"] = False
    args = ["fit", "--config", str(config_path),
            "--data", json.dumps({"class_path": "ssl_lightning.ImageFolderDataModule",
                                  "init_args": data_args})]

    config_backbone = ((config.get("model") or {}).get("init_args") or {}).get("backbone")
    if backbone is not None:
        args += ["--model.backbone", json.dumps(backbone_spec(backbone, preset))]
    elif preset == "imagenet" and isinstance(config_backbone, dict):
        args += ["--model.backbone", json.dumps(_imagenet_backbone(config_backbone))]

    out = Path(out)
    args += ["--trainer.logger.init_args.save_dir", str(out.parent),
             "--trainer.logger.init_args.name", out.name]
    for flag, value in (("--trainer.max_epochs", epochs), ("--data.batch_size", batch_size),
                        ("--trainer.devices", devices)):
        if value is not None:
            args += [flag, str(value)]
    cli = main([*args, *overrides])

    trainer = cli.trainer
    run_dir = Path(trainer.log_dir or trainer.default_root_dir)
    last = next((Path(cb.last_model_path) for cb in trainer.checkpoint_callbacks
                 if getattr(cb, "last_model_path", "")), None)
    return PretrainResult(module=cli.model, run_dir=run_dir, last_checkpoint=last,
                          exported_backbone=_exported(run_dir))
