"""Every ``configs/*.yaml`` runs through the real CLI (fast_dev_run, CPU, tiny data).

New configs are picked up automatically. ``run_config`` (tests/conftest.py) points the config's
data module at the tiny image folder and adds the CPU / fast_dev_run trainer flags; a config that
needs more registers it here:

- ``EXTRA_ARGS[name]``: extra CLI arguments (e.g. a smaller backbone or crop size); a method's
  configs take theirs from the registry (``cli_args`` of its ``@register_method``).
- ``SUBCOMMANDS[name]``: the LightningCLI subcommand when it is not ``fit`` (e.g. ``validate``).
- ``PREPARE[name]``: a function ``(tmp_path, request) -> list[str]`` run before the config, for
  what must exist first (e.g. a pre-training checkpoint for the linear-evaluation config); it may
  call ``pytest.skip(reason)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from conftest import read_config

from ssl_lightning.methods.registry import method_entries

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

#: Extra CLI arguments of the evaluation configs; a method's configs take theirs from its
#: registry entry (``cli_args``, in the method's file).
EXTRA_ARGS: dict[str, list[str]] = {
    "fewshot.yaml": ["--model.init_args.shots", "[1, 2]", "--model.init_args.draws", "2"],
    **{config: list(args) for entry in method_entries() for config, args in
       entry.cli_args.items()},
}


def _pretraining_checkpoint(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """A real (1-step) SimCLR checkpoint with the configs' ResNet-18 CIFAR backbone."""
    from evaluation_helpers import simclr_checkpoint

    from ssl_lightning.backbones import ResNet

    path = str(tmp_path / "pretrain.ckpt")
    simclr_checkpoint(ResNet(18, cifar_stem=True), path, steps=1)
    return ["--model.checkpoint", path]


def _vit_checkpoint(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """A real (1-step) SimCLR checkpoint of a tiny 4-block ViT (the probe grids' last 4 blocks)."""
    from evaluation_helpers import simclr_checkpoint

    from ssl_lightning.backbones import ViT

    path = str(tmp_path / "pretrain_vit.ckpt")
    simclr_checkpoint(ViT(image_size=32, patch_size=8, embed_dim=16, depth=4, num_heads=2), path,
                      view_size=32, steps=1)
    return ["--model.checkpoint", path]


def _distillation_teacher(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """A 1-step SimCLR checkpoint of a tiny ViT as the teacher (its student, backbone.)."""
    from evaluation_helpers import simclr_checkpoint

    from ssl_lightning.backbones import ViT

    path = str(tmp_path / "teacher.ckpt")
    simclr_checkpoint(ViT(image_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2), path,
                      view_size=32, steps=1)
    return ["--model.teacher_checkpoint", path, "--model.teacher_checkpoint_prefix", "backbone."]


def _timm_teacher_file(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """The config's timm teacher, shrunk to one block, saved as a local weights file."""
    from ssl_lightning.backbones import TimmBackbone

    kwargs = {"depth": 1, "embed_dim": 32, "num_heads": 2}
    path = str(tmp_path / "teacher.pt")
    torch.save(TimmBackbone("vit_small_patch14_dinov2.lvd142m", model_kwargs=kwargs).net
               .state_dict(), path)
    return ["--model.teacher.init_args.pretrained_path", path,
            "--model.teacher.init_args.model_kwargs", json.dumps(kwargs),
            "--model.teacher_image_size", "28"]


SUBCOMMANDS: dict[str, str] = {
    "knn.yaml": "validate",
    "fewshot.yaml": "validate",
    "seg_knn.yaml": "validate",
}

def _released_backbone(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """A random ViT of the shrunk shape (see EXTRA_ARGS) saved as the released backbone file
    that the config's (dinov3_continue.yaml's, neco.yaml's) ``pretrained_path`` names."""
    import torch

    from ssl_lightning.backbones import ViT

    config = read_config(ROOT / "configs" / request.node.callspec.params["config"].name)
    init = dict(config["model"]["init_args"]["backbone"]["init_args"])
    assert init.pop("pretrained_path")
    torch.manual_seed(0)
    path = tmp_path / "released_backbone.pt"
    torch.save(ViT(**{**init, "embed_dim": 32, "depth": 1, "num_heads": 2}).state_dict(), path)
    return ["--model.init_args.backbone.init_args.pretrained_path", str(path)]


def _dense_probe_data(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    """A SimCLR checkpoint and tiny synthetic segmentation or depth data (tests/dense_utils.py)
    at 32 px for the dense-probe configs."""
    from dense_utils import make_depth_folder, make_segmentation_folder

    name = request.node.callspec.params["config"].name
    depth = name.startswith("depth")
    root = (make_depth_folder if depth else make_segmentation_folder)(tmp_path / "dense",
                                                                      train=8, val=2)
    args = [*_pretraining_checkpoint(tmp_path, request), "--data.root", str(root),
            "--data.batch_size", "4", "--data.num_workers", "0", "--data.crop_size", "32",
            "--data.eval_size", "null", "--data.layout", "folders"]
    if depth:
        args += ["--data.resize_size", "32"]
    else:
        args += ["--data.num_classes", "3", "--model.num_classes", "3"]
    if name != "seg_knn.yaml":
        args += ["--model.crop_size", "32", "--model.stride", "null", "--model.image_size", "32"]
    return args


PREPARE: dict[str, Callable[[Path, pytest.FixtureRequest], list[str]]] = {
    **{name: _dense_probe_data for name in ("seg_linear.yaml", "seg_knn.yaml",
                                            "depth_linear.yaml")},
    "dinov3_continue.yaml": _released_backbone,
    "neco.yaml": _released_backbone,
    "linear.yaml": _pretraining_checkpoint,
    "knn.yaml": _pretraining_checkpoint,
    "fewshot.yaml": _pretraining_checkpoint,
    "linear_grid.yaml": _vit_checkpoint,
    "attentive.yaml": _vit_checkpoint,
    "distillation.yaml": _distillation_teacher,
    "distillation_timm.yaml": _timm_teacher_file,
}


def test_there_are_configs() -> None:
    assert any(path.name == "simclr.yaml" for path in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_config_runs_through_the_cli(
    config: Path, run_config, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    extra = list(EXTRA_ARGS.get(config.name, []))
    if config.name in PREPARE:
        extra += PREPARE[config.name](tmp_path, request)
    subcommand = SUBCOMMANDS.get(config.name, "fit")
    cli = run_config(config, extra, subcommand=subcommand)
    assert cli.trainer.state.finished
    declared = read_config(config)
    assert type(cli.model).__name__ == declared["model"]["class_path"].rpartition(".")[2]
    metrics = cli.trainer.callback_metrics
    if subcommand == "fit":
        assert cli.trainer.global_step >= 1
        losses = [v for k, v in metrics.items() if k.endswith("loss")]
        assert losses and all(math.isfinite(float(v)) for v in losses)
    callbacks = (declared.get("trainer") or {}).get("callbacks") or []
    if any(c["class_path"].endswith("KNNCallback") for c in callbacks):
        assert 0.0 <= float(metrics["val/knn_top1"]) <= 100.0  # percent; validation ran


def test_simclr_config_has_the_documented_defaults() -> None:
    config = read_config(ROOT / "configs" / "simclr.yaml")
    trainer, model = config["trainer"], config["model"]["init_args"]
    assert trainer["logger"]["init_args"] == {"save_dir": "runs", "name": "simclr"}
    callbacks = {c["class_path"].rpartition(".")[2]: c.get("init_args", {})
                 for c in trainer["callbacks"]}
    assert callbacks["ModelCheckpoint"]["monitor"] == "val/knn_top1"
    assert callbacks["ModelCheckpoint"]["mode"] == "max" and callbacks["ModelCheckpoint"][
        "save_last"]
    assert {"LearningRateMonitor", "TQDMProgressBar", "KNNCallback", "OnlineProbe"} <= set(
        callbacks)
    assert model["backbone"]["init_args"] == {"depth": 18, "cifar_stem": True}
    assert model["temperature"] == 0.5 and model["optimizer"] == "lars"
    assert config["data"]["init_args"]["root"] == "data/cifar10"



def test_pretraining_configs_share_one_callbacks_piece() -> None:
    """The checkpoint / kNN / probe callbacks are written once, in configs/shared/."""
    pretraining = [c for c in CONFIGS if c.name not in SUBCOMMANDS and c.name not in PREPARE]
    assert len(pretraining) >= 16
    for config in pretraining:
        callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
        assert callbacks == "shared/pretrain_callbacks.yaml", config.name
