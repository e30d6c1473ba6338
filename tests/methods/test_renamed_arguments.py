"""Renamed method arguments and teacher prefixes keep working under their old names.

- Every old argument name is accepted, from Python and from a LightningCLI config, with a
  ``FutureWarning`` naming the new one, builds the same model as the new name, and is not saved.
- Checkpoints whose teachers are named ``key_*`` (MoCo) or ``target_*`` (BYOL) load, resume to
  the same state as the checkpoint with the new names, and evaluate (LinearEval, the backbone
  loader of embed / export) under old and new prefixes.
- Validation errors name the argument the user passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.backbones.vit import ViT
from ssl_lightning.cli import main
from ssl_lightning.cli.resume import check_architecture
from ssl_lightning.evaluation import LinearEval
from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint, backbone_state_dict
from ssl_lightning.methods import (
    BYOL,
    DCL,
    IBOT,
    NNCLR,
    BarlowTwins,
    MoCoV2,
    MoCoV3,
    SimCLR,
    SimSiam,
    SupCon,
    SwAV,
    VICReg,
)
from ssl_lightning.testing.trainer_runs import PrecomputedViews, TensorDataModule, fit_and_dump

HEADS = {"projection_hidden_dim": 8, "projection_dim": 4}
#: (class, small arguments, old name, new name, a value other than the default).
RENAMED = [
    (SimCLR, HEADS, "projection_batch_norm", "head_batch_norm", False),
    (SimCLR, HEADS, "memory_bank_size", "queue_size", 8),
    (DCL, HEADS, "projection_batch_norm", "head_batch_norm", False),
    (MoCoV2, dict(HEADS, queue_size=8), "projection_batch_norm", "head_batch_norm", True),
    (BarlowTwins, HEADS, "projection_batch_norm", "head_batch_norm", False),
    (SupCon, HEADS, "projection_batch_norm", "head_batch_norm", False),
    (SwAV, dict(HEADS, num_prototypes=5), "projection_batch_norm", "head_batch_norm", False),
    (SwAV, dict(HEADS, num_prototypes=5), "queue_length", "queue_size", 8),
    (VICReg, {"expander_hidden_dim": 8, "expander_dim": 4}, "expander_batch_norm",
     "head_batch_norm", False),
    (SimSiam, dict(HEADS, predictor_hidden_dim=4), "batch_norm", "head_batch_norm", False),
    (NNCLR, dict(HEADS, queue_size=8), "prediction_hidden_dim", "predictor_hidden_dim", 6),
    (NNCLR, dict(HEADS, predictor_hidden_dim=4), "support_set_size", "queue_size", 8),
]
IDS = [f"{cls.__name__}-{old}" for cls, _, old, _, _ in RENAMED]


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("cls", "small", "old", "new", "value"), RENAMED, ids=IDS)
def test_an_old_argument_name_warns_and_builds_the_model_of_the_new_name(
        cls: type, small: dict, old: str, new: str, value: Any) -> None:
    with pytest.warns(FutureWarning, match=rf"{cls.__name__}: the argument {old} is "
                                           rf"deprecated .* use {new} instead"):
        legacy = cls(SmallConvNet((8,)), **small, **{old: value})
    current = cls(SmallConvNet((8,)), **small, **{new: value})
    default = cls(SmallConvNet((8,)), **small)
    assert _shapes(legacy) == _shapes(current) != _shapes(default)
    assert legacy.hparams[new] == value and old not in legacy.hparams


def test_the_old_and_the_new_name_together_are_refused() -> None:
    with pytest.raises(ValueError, match="SimCLR got both memory_bank_size=8 and queue_size=16; "
                                         "memory_bank_size is the deprecated name of queue_size"):
        SimCLR(SmallConvNet((8,)), **HEADS, memory_bank_size=8, queue_size=16)


@pytest.mark.parametrize(("cls", "small", "old", "new", "value"), RENAMED, ids=IDS)
def test_an_old_argument_name_in_a_config_is_accepted_by_the_cli(
        cls: type, small: dict, old: str, new: str, value: Any, tmp_path: Path) -> None:
    backbone = {"class_path": "SmallConvNet", "init_args": {"widths": [8]}}
    config = {"model": {"class_path": cls.__name__,
                        "init_args": {"backbone": backbone, **small, old: value}},
              "data": {"class_path": "CIFAR10DataModule",
                       "init_args": {"root": str(tmp_path), "download": False}},
              "trainer": {"accelerator": "cpu", "logger": False}}
    path = tmp_path / "old_names.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.warns(FutureWarning, match=rf"the argument {old} is deprecated .* use {new}"):
        cli = main(["--config", str(path)], run=False)
    assert cli.model.hparams[new] == value and old not in cli.model.hparams


# ----------------------------------------------------------------- teacher prefixes of checkpoints
#: method -> (constructor, new teacher prefix -> the old one it had).
OLD_PREFIXES = {
    "moco_v2": (lambda: MoCoV2(SmallConvNet((4, 8)), **HEADS, queue_size=8, optimizer="sgd",
                               lr=0.5, warmup_epochs=0, head_batch_norm=True),
                {"teacher_backbone.": "key_backbone.", "teacher_projector.": "key_projector."}),
    "moco_v3": (lambda: MoCoV3(SmallConvNet((4, 8)), **HEADS, projection_layers=2,
                               optimizer="sgd", lr=0.5, warmup_epochs=0),
                {"teacher_backbone.": "key_backbone.", "teacher_projector.": "key_projector."}),
    "byol": (lambda: BYOL(SmallConvNet((4, 8)), **HEADS, optimizer="sgd", lr=0.5,
                          warmup_epochs=0),
             {"teacher_backbone.": "target_backbone.", "teacher_projector.": "target_projector."}),
}


class _StopAfterEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def _data() -> TensorDataModule:
    return TensorDataModule(PrecomputedViews(8, num_classes=3), batch_size=4)


def _as_old_checkpoint(path: str, old_path: str, prefixes: dict[str, str]) -> None:
    """Rewrite the checkpoint at ``path`` with the teacher prefixes and argument names of before
    the rename (MoCo v2's ``projection_batch_norm``)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    renamed = {}
    for key, value in checkpoint["state_dict"].items():
        new = next((p for p in prefixes if key.startswith(p)), None)
        renamed[key if new is None else prefixes[new] + key[len(new):]] = value
    assert renamed.keys() != checkpoint["state_dict"].keys()
    checkpoint["state_dict"] = renamed
    hparams = checkpoint["hyper_parameters"]
    if "_class_path" in hparams and hparams["_class_path"].endswith("MoCoV2"):
        hparams["projection_batch_norm"] = hparams.pop("head_batch_norm")
    torch.save(checkpoint, old_path)


@pytest.fixture(scope="module", params=sorted(OLD_PREFIXES))
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(method name, checkpoint after epoch 1 with the new names, the same with the old ones)."""
    name = request.param
    build, prefixes = OLD_PREFIXES[name]
    out = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    fit_and_dump(build(), _data(), max_epochs=2, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=out, save_last=True), _StopAfterEpoch()])
    new, old = str(out / "last.ckpt"), str(out / "old_names.ckpt")
    _as_old_checkpoint(new, old, prefixes)
    return name, new, old


def test_a_checkpoint_with_the_old_teacher_names_resumes_like_the_new_one(checkpoints) -> None:
    name, new, old = checkpoints
    build = OLD_PREFIXES[name][0]
    from_new = fit_and_dump(build(), _data(), max_epochs=2, ckpt_path=new)[0]
    from_old = fit_and_dump(build(), _data(), max_epochs=2, ckpt_path=old)[0]
    assert from_old["global_step"] == from_new["global_step"] == 4
    assert from_old["model"].keys() == from_new["model"].keys()
    for key, value in from_new["model"].items():
        assert torch.equal(from_old["model"][key], value), key
    for key, value in from_new["optimizer"][0]["state"].items():
        assert torch.equal(from_old["optimizer"][0]["state"][key]["momentum_buffer"],
                           value["momentum_buffer"])


def test_a_checkpoint_with_the_old_teacher_names_passes_the_resume_check_and_loads(
        checkpoints) -> None:
    name, new, old = checkpoints
    build, prefixes = OLD_PREFIXES[name]
    check_architecture(build(), torch.load(old, weights_only=True), old)
    cls = type(build())
    loaded = cls.load_from_checkpoint(old, backbone=SmallConvNet((4, 8)))
    expected = torch.load(new, weights_only=True)["state_dict"]
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_old_and_new_teacher_prefixes_evaluate_the_teacher_of_either_checkpoint(
        checkpoints) -> None:
    name, new, old = checkpoints
    prefixes = OLD_PREFIXES[name][1]
    for new_prefix, old_prefix in prefixes.items():
        expected = backbone_state_dict(new, new_prefix)
        assert expected
        with pytest.warns(FutureWarning, match=f"prefix {old_prefix!r} is deprecated"):
            by_old_name = backbone_state_dict(old, old_prefix)
        for state in (backbone_state_dict(old, new_prefix), by_old_name):
            assert state.keys() == expected.keys()
            assert all(torch.equal(state[k], v) for k, v in expected.items())
    teacher = backbone_state_dict(new, "teacher_backbone.")
    old_backbone = next(p for p in prefixes.values() if p.endswith("backbone."))
    with pytest.warns(FutureWarning):
        embedded = backbone_from_checkpoint(old, prefix=old_backbone)  # embed / export
    probe = LinearEval(checkpoint=old, checkpoint_prefix="teacher_backbone.", num_classes=3)
    for module in (embedded, probe.backbone):
        assert all(torch.equal(module.state_dict()[k], v) for k, v in teacher.items())


# --------------------------------------------------------------------- errors name the argument
def _vit() -> ViT:
    return ViT(image_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, mask_token=True)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: IBOT(_vit(), head_out_dim=8, mask_min_patches=0), "mask_min_patches must be >= 1"),
    (lambda: IBOT(_vit(), head_out_dim=8, mask_probability=1.5), "mask_probability must be in"),
    (lambda: IBOT(_vit(), head_out_dim=8, mask_ratio=(0.6, 0.2)), "mask_ratio must satisfy"),
    (lambda: SimCLR(SmallConvNet((8,)), queue_size=-1), "queue_size must be >= 0"),
    (lambda: MoCoV2(SmallConvNet((8,)), queue_size=0), r"queue_size \(the negatives\) must be"),
    (lambda: SwAV(SmallConvNet((8,)), queue_size=-8), "queue_size must be >= 0"),
])
def test_validation_errors_name_the_argument_the_user_passed(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()



def test_resuming_an_old_name_checkpoint_warns_about_no_renamed_hyperparameter() -> None:
    """The resume check compares hyperparameters under their new names: a checkpoint saved
    with ``projection_batch_norm`` matches a config that says ``head_batch_norm``."""
    import warnings

    from ssl_lightning.cli.resume import check_method_and_hyperparameters

    checkpoint = {"hyper_parameters": {"_class_path": "ssl_lightning.SimCLR", "lr": 0.1,
                                       "projection_batch_norm": False, "memory_bank_size": 8}}
    config = {"class_path": "ssl_lightning.SimCLR",
              "init_args": {"lr": 0.1, "head_batch_norm": False, "queue_size": 8,
                            "projection_batch_norm": None, "memory_bank_size": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_method_and_hyperparameters(checkpoint, "old.ckpt", config)
    config["init_args"]["queue_size"] = 16
    with pytest.warns(UserWarning, match=r"queue_size: 8 \(checkpoint\) -> 16 \(this run\)"):
        check_method_and_hyperparameters(checkpoint, "old.ckpt", config)
