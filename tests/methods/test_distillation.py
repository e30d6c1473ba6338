"""Distillation (methods/distillation.py): the frozen teacher (unchanged by training, in eval
mode, absent from the checkpoint, rebuilt and fingerprint-checked on load, from a module, a spec
or our checkpoint), the argument checks, and students of other kinds through the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.data import ImageFolderDataModule, SimCLRViews
from ssl_lightning.methods import Distillation
from ssl_lightning.methods.distillation import FINGERPRINT_KEY
from ssl_lightning.training.grad_cache import grad_cached_loss

ROOT = Path(__file__).resolve().parents[2]
SIZE = 16


def _student() -> SmallConvNet:
    return SmallConvNet((8, 16))


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([t.flatten().double() for t in module.state_dict().values()])


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, tiny_image_folder: Path) -> dict[str, Any]:
    """3 steps of the default variant with a SmallConvNet teacher read from a weights file."""
    tmp = tmp_path_factory.mktemp("distillation")
    torch.manual_seed(1)
    teacher_file = tmp / "teacher.pt"
    torch.save(SmallConvNet((8, 16)).state_dict(), teacher_file)
    torch.manual_seed(0)
    model = Distillation(_student(), teacher=SmallConvNet((8, 16), pretrained_path=str(
        teacher_file)), queue_size=8, image_size=SIZE, lr=0.05, warmup_epochs=0)
    before = {"teacher": _flat(model.teacher), "student": _flat(model.backbone)}
    modes: list[bool] = []

    class RecordTeacherMode(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            modes.append(model.teacher.training)

    data = ImageFolderDataModule(
        str(tiny_image_folder / "train"), str(tiny_image_folder / "test"), preset="cifar",
        batch_size=4, num_workers=0, train_transform=SimCLRViews("cifar", num_views=1,
                                                                 crop_size=SIZE))
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, callbacks=[RecordTeacherMode()])
    trainer.fit(model, data)
    ckpt = tmp / "distilled.ckpt"
    trainer.save_checkpoint(ckpt)
    return {"model": model, "before": before, "ckpt": ckpt, "teacher_file": teacher_file,
            "modes": modes}


def test_teacher_is_unchanged_in_eval_mode_and_absent_from_the_checkpoint(fitted) -> None:  # type: ignore[no-untyped-def]
    model, before = fitted["model"], fitted["before"]
    assert fitted["modes"] == [False, False, False]
    assert torch.equal(_flat(model.teacher), before["teacher"])
    assert not torch.equal(_flat(model.backbone), before["student"])  # the student trained
    checkpoint = torch.load(fitted["ckpt"], map_location="cpu", weights_only=True)
    keys = list(checkpoint["state_dict"])
    assert not [k for k in keys if k.startswith("teacher.")]
    assert any(k.startswith("backbone.") for k in keys) and "queue.queue" in keys
    assert FINGERPRINT_KEY in checkpoint
    assert checkpoint["hyper_parameters"]["teacher_spec"]["init_args"]["pretrained_path"] == str(
        fitted["teacher_file"])


def test_load_rebuilds_the_teacher_and_refuses_another(fitted, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = fitted["model"]
    loaded = Distillation.load_from_checkpoint(fitted["ckpt"])  # student and teacher rebuilt
    assert torch.equal(_flat(loaded.teacher), _flat(model.teacher))
    assert torch.equal(_flat(loaded.backbone), _flat(model.backbone))
    assert torch.equal(loaded.queue.queue, model.queue.queue)
    assert not loaded.teacher.training and not any(p.requires_grad
                                                   for p in loaded.teacher.parameters())
    other = tmp_path / "other.pt"
    torch.save(SmallConvNet((8, 16)).state_dict(), other)
    with pytest.raises(ValueError, match="other weights than the one it was trained with"):
        Distillation.load_from_checkpoint(
            fitted["ckpt"], backbone=_student(),
            teacher_spec={"class_path": "ssl_lightning.SmallConvNet",
                          "init_args": {"widths": [8, 16], "pretrained_path": str(other)}})


def test_teacher_from_one_of_our_checkpoints(fitted) -> None:  # type: ignore[no-untyped-def]
    model = Distillation(_student(), teacher_checkpoint=str(fitted["ckpt"]), queue_size=8,
                         image_size=SIZE)
    assert torch.equal(_flat(model.teacher), _flat(fitted["model"].backbone))


def test_a_wrong_teacher_prefix_names_the_distillation_setting(fitted) -> None:  # type: ignore[no-untyped-def]
    """A SimCLR teacher has no teacher_backbone.: the error says which Distillation setting
    chooses the prefix (not LinearEval's checkpoint_prefix, an unknown argument here)."""
    with pytest.raises(ValueError,
                       match=r"choose one with --model\.teacher_checkpoint_prefix "
                             r"\(e\.g\. --model\.teacher_checkpoint_prefix backbone\.\)"):
        Distillation(_student(), teacher_checkpoint=str(fitted["ckpt"]),
                     teacher_checkpoint_prefix="teacher_backbone.", queue_size=8,
                     image_size=SIZE)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="exactly one of teacher, teacher_checkpoint"):
        Distillation(_student(), image_size=SIZE)
    with pytest.raises(ValueError, match=r"got \['teacher', 'teacher_spec'\]"):
        Distillation(_student(), teacher=_student(), teacher_spec={"class_path": "x"})
    with pytest.raises(ValueError, match="teacher_blocks=2 needs a teacher with forward_dense"):
        Distillation(_student(), teacher=_student(), variant="patch_mse", image_size=SIZE)
    with pytest.raises(ValueError, match="Sequential has no dense features"):
        Distillation(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()),
                     teacher=_student(), image_size=SIZE)
    with pytest.raises(ValueError, match="variant must be one of"):
        Distillation(_student(), teacher=_student(), variant="local")  # type: ignore[arg-type]


def test_patch_mse_regresses_the_last_two_vit_blocks() -> None:
    teacher = ViT(image_size=SIZE, patch_size=4, embed_dim=16, depth=2, num_heads=2)
    model = Distillation(_student(), teacher=teacher, variant="patch_mse", image_size=SIZE,
                         head_hidden_dim=8, mixup=False)
    outputs = model.forward_views([torch.randn(2, 3, SIZE, SIZE)])
    assert outputs["teacher_patches"].shape == outputs["student_patches"].shape == (2, 16, 32)
    assert not hasattr(model, "global_head")


def _teacher_checkpoint(tmp_path: Path) -> list[str]:
    from evaluation_helpers import simclr_checkpoint

    path = str(tmp_path / "teacher.ckpt")
    simclr_checkpoint(ViT(image_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2), path,
                      view_size=32, steps=1)
    return ["--model.teacher_checkpoint", path, "--model.teacher_checkpoint_prefix", "backbone.",
            "--model.queue_size", "8"]


STUDENTS = {
    "timm_convnext": '{"class_path": "ssl_lightning.TimmBackbone", "init_args": {"name": '
                     '"convnext_atto", "model_kwargs": {"depths": [1, 1, 1, 1]}}}',
    "vit": '{"class_path": "ssl_lightning.ViT", "init_args": {"image_size": 32, "patch_size": 8,'
           ' "embed_dim": 16, "depth": 1, "num_heads": 2}}',
}


@pytest.mark.parametrize("student", sorted(STUDENTS))
def test_students_of_other_kinds_through_the_cli(student: str, run_config,  # type: ignore[no-untyped-def]
                                                 tmp_path: Path) -> None:
    """The config's ResNet-18 student runs in tests/product/test_configs.py."""
    cli = run_config(ROOT / "configs" / "distillation.yaml",
                     ["--model.backbone", STUDENTS[student], *_teacher_checkpoint(tmp_path)])
    assert cli.trainer.state.finished and cli.trainer.global_step == 1
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert type(cli.model.backbone).__name__ == {"timm_convnext": "TimmBackbone",
                                                  "vit": "ViT"}[student]


def test_micro_batches_give_the_whole_batch_gradients() -> None:
    """Gradient caching: the teacher runs per micro-batch, the queue and the loss once."""
    grads = []
    for micro in (None, 2):
        torch.manual_seed(0)
        teacher = ViT(image_size=SIZE, patch_size=4, embed_dim=16, depth=1, num_heads=2)
        model = Distillation(_student(), teacher=teacher, queue_size=8, image_size=SIZE,
                             micro_batch_size=micro).double()
        x = torch.randn(4, 3, SIZE, SIZE, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(3))
        loss = (grad_cached_loss(model, [x], micro, 1.0)[0] if micro else
                model.training_loss([x])[0])
        loss.backward()
        grads.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                                if p.grad is not None]), model.queue.queue))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-12, rtol=0)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-10, rtol=0)
    torch.testing.assert_close(grads[1][2], grads[0][2], atol=1e-12, rtol=0)  # fp64 rounding
