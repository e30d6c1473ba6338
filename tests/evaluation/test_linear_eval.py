"""LinearEval: frozen backbone (weights and BN statistics), accuracy, recipe, checkpoint errors."""

from __future__ import annotations

import argparse
import copy
import math
import os

import pytest
import pytorch_lightning as pl
import torch
from evaluation_helpers import simclr_checkpoint, tiny_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.evaluation import LinearEval, load_backbone
from ssl_lightning.training.divergence import TrainingDivergedError

NUM_CLASSES = 4


def bn_backbone() -> nn.Module:
    """A fixed random conv + BatchNorm feature extractor with non-default running statistics."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten())
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(8, 3, 8, 8) * 2 + 1)
    return net


def separable_data(n: int, seed: int) -> TensorDataset:
    """Images whose colour is fixed by the class (plus noise): linearly separable features."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 0, 2.0], [-2.0, -2.0, -2.0]])
    targets = torch.arange(n) % NUM_CLASSES
    images = colours[targets][:, :, None, None] + 0.3 * torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(images, targets)


def fit_linear(model: LinearEval, epochs: int = 6, views: bool = False) -> object:
    train, val = separable_data(64, 0), separable_data(32, 1)
    if views:  # ([images], targets) batches, as LinearEvalTransform gives
        train = [([x], y) for x, y in train]
    trainer = tiny_trainer(max_epochs=epochs, check_val_every_n_epoch=epochs)
    torch.manual_seed(1)
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, 32))
    return trainer


def make_model(**kwargs: object) -> LinearEval:
    return LinearEval(bn_backbone(), NUM_CLASSES, checkpoint="random", lr=0.5, lr_scaling="none",
                      **kwargs)


def test_frozen_linear_eval_separates_and_keeps_backbone_and_bn_stats():
    model = make_model(weight_decay=1e-4)
    before = copy.deepcopy(model.backbone.state_dict())
    classifier_before = model.classifier.heads[0].weight.detach().clone()
    trainer = fit_linear(model)
    assert trainer.callback_metrics["val/top1"] == pytest.approx(100.0)
    assert trainer.callback_metrics["val/top5"] == pytest.approx(100.0)
    for key, value in model.backbone.state_dict().items():  # weights, running stats, counters
        assert torch.equal(value, before[key]), key
    assert not model.backbone.training and model.training
    assert not torch.equal(model.classifier.heads[0].weight, classifier_before)
    # the recipe: SGD + momentum, classifier only, weight decay on the weight but not the bias,
    # cosine to 0 at the last step
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, torch.optim.SGD)
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    assert set(groups) == {id(model.classifier.heads[0].weight), id(model.classifier.heads[0].bias)}
    assert groups[id(model.classifier.heads[0].weight)]["weight_decay"] == 1e-4
    assert groups[id(model.classifier.heads[0].bias)]["weight_decay"] == 0.0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_finetune_trains_backbone_and_updates_bn_stats():
    """The known-bad variant for the frozen check: fine-tuning changes the BN statistics."""
    model = make_model(finetune=True)
    before = copy.deepcopy(model.backbone.state_dict())
    fit_linear(model, epochs=1)
    assert model.backbone.training
    assert not torch.equal(model.backbone[1].running_mean, before["1.running_mean"])
    assert not torch.equal(model.backbone[0].weight, before["0.weight"])


def test_logged_accuracy_matches_manual_top1_top5():
    """Untrained 8-class classifier on 4-class data: top-1 and top-5 are both non-trivial."""
    model = LinearEval(bn_backbone(), 8, checkpoint="random")
    nn.init.normal_(model.classifier.heads[0].weight, std=1.0)
    images, targets = separable_data(32, 1).tensors
    # val loaders [train_eval, val] as the data modules give them: only the last one is scored
    bank = DataLoader(TensorDataset(images, (targets + 1) % NUM_CLASSES), batch_size=8)
    trainer = tiny_trainer()
    trainer.validate(model, [bank, DataLoader(TensorDataset(images, targets), batch_size=8)])
    with torch.no_grad():
        top = model(images).topk(5, dim=1).indices
    top1 = 100 * (top[:, 0] == targets).float().mean()
    top5 = 100 * (top == targets[:, None]).any(1).float().mean()
    assert 0 < top1 < top5 < 100
    assert trainer.callback_metrics["val/top1"] == pytest.approx(float(top1))
    assert trainer.callback_metrics["val/top5"] == pytest.approx(float(top5))


def test_view_list_batches_give_the_same_result_as_image_batches():
    a, b = make_model(), make_model()
    fit_linear(a, epochs=1)
    fit_linear(b, epochs=1, views=True)
    assert torch.equal(a.classifier.heads[0].weight, b.classifier.heads[0].weight)


def test_loads_backbone_of_a_method_checkpoint(tmp_path):
    path = str(tmp_path / "simclr.ckpt")
    simclr = simclr_checkpoint(SmallConvNet((8, 16), norm="group"), path)
    model = LinearEval(SmallConvNet((8, 16), norm="group"), 4, checkpoint=path)
    for key, value in simclr.backbone.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[key], value), key
    assert not any(p.requires_grad for p in model.backbone.parameters())


def test_wrong_checkpoint_errors(tmp_path):
    good = str(tmp_path / "good.ckpt")
    simclr_checkpoint(SmallConvNet((8, 16), norm="group"), good)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        LinearEval(SmallConvNet((8, 16)), 4, checkpoint=str(tmp_path / "missing.ckpt"))
    for i, content in enumerate(["not a checkpoint", "hello", ""]):
        text = tmp_path / f"notes{i}.ckpt"
        text.write_text(content)
        with pytest.raises(ValueError, match="cannot be read|is empty"):
            LinearEval(SmallConvNet((8, 16)), 4, checkpoint=str(text))
    plain = str(tmp_path / "plain.pt")
    torch.save(SmallConvNet((8, 16)).state_dict(), plain)
    with pytest.raises(ValueError, match="no 'state_dict' entry"):
        LinearEval(SmallConvNet((8, 16)), 4, checkpoint=plain)
    with pytest.raises(ValueError, match=r"no weights under 'teacher\.'.*'backbone\.'"):
        LinearEval(SmallConvNet((8, 16)), 4, checkpoint=good, checkpoint_prefix="teacher.")
    with pytest.raises(ValueError, match=r"'net\.3\.weight'.*\(16, 8, 3, 3\).*\(24, 8, 3, 3\)"):
        LinearEval(SmallConvNet((8, 24), norm="group"), 4, checkpoint=good)
    with pytest.raises(ValueError, match=r"missing keys \['net\.6\.weight'"):
        LinearEval(SmallConvNet((8, 16, 16), norm="group"), 4, checkpoint=good)
    with pytest.raises(ValueError, match="unexpected keys"):
        load_backbone(SmallConvNet((8, 16), norm="none"), good)
    assert os.path.exists(good)


def test_checkpoint_with_pickled_python_objects_is_refused(tmp_path):
    """weights_only=True refuses e.g. a Namespace in the hyperparameters, naming the object."""
    backbone = SmallConvNet((8, 16))
    path = str(tmp_path / "ns.ckpt")
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in backbone.state_dict().items()},
                "hyper_parameters": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(ValueError, match=r"ns\.ckpt' is refused: .* argparse\.Namespace"):
        LinearEval(SmallConvNet((8, 16)), 4, checkpoint=path)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_classes": 1}, "num_classes"), ({"lr": 0.0}, "lr"),
    ({"weight_decay": -1.0}, "weight_decay"), ({"warmup_epochs": -1.0}, "warmup_epochs"),
])
def test_invalid_hyperparameters(kwargs, match):
    args = {"num_classes": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        LinearEval(SmallConvNet((8,)), **args)


class StopAfterFirstEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True


def test_resume_is_exact(tmp_path):
    """fit 2 epochs == fit stopped after epoch 1 + resume to 2 (same cosine schedule)."""
    train, val = separable_data(32, 0), separable_data(16, 1)

    def run(callbacks: list, ckpt_path: str | None = None) -> tuple[LinearEval, pl.Trainer]:
        model = make_model(weight_decay=1e-4)
        trainer = tiny_trainer(max_epochs=2, callbacks=callbacks)
        trainer.fit(model, DataLoader(train, batch_size=8), DataLoader(val, 16),
                    ckpt_path=ckpt_path)
        return model, trainer

    straight, _ = run([])
    _, first = run([StopAfterFirstEpoch()])
    assert first.global_step == 4
    first.save_checkpoint(str(tmp_path / "epoch1.ckpt"))
    resumed, trainer = run([], str(tmp_path / "epoch1.ckpt"))
    assert trainer.global_step == 8
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


class LrRecorder(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.lrs.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))


def test_resume_with_more_epochs_follows_the_new_schedule(tmp_path):
    """1 epoch (4 steps), then resumed to 2: the resumed steps follow the 8-step cosine (a
    ``LambdaLR`` restores the old 4-step schedule and trains the second epoch at lr 0)."""
    train, val = separable_data(32, 0), separable_data(16, 1)
    trainer = tiny_trainer(max_epochs=1)
    trainer.fit(make_model(), DataLoader(train, batch_size=8))
    trainer.save_checkpoint(str(tmp_path / "epoch1.ckpt"))
    recorder = LrRecorder()
    with pytest.warns(UserWarning, match="total steps 4 -> 8"):
        tiny_trainer(max_epochs=2, callbacks=[recorder]).fit(
            make_model(), DataLoader(train, batch_size=8), DataLoader(val, 16),
            ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert [s for s, _ in recorder.lrs] == [4, 5, 6, 7]
    for step, lr in recorder.lrs:  # lr 0.5, no warm-up, half a cosine over 8 steps
        assert lr == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * step / 8)), rel=1e-12)
        assert lr > 1e-3


class NaNFromStep2(nn.Module):
    """A frozen feature extractor whose features become NaN from its third training call."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.calls = bn_backbone(), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        features = self.net(x)
        return features * float("nan") if self.calls >= 3 else features


def test_a_non_finite_loss_stops_linear_eval_at_that_step(tmp_path):
    model = LinearEval(NaNFromStep2(), NUM_CLASSES, checkpoint="random", lr=0.5,
                       lr_scaling="none", image_size=8)
    model.backbone.calls = 0  # the feature-size probe at construction was one call
    trainer = tiny_trainer(max_epochs=1, limit_val_batches=0)
    with pytest.raises(TrainingDivergedError, match=r"loss is nan at global step 2 .*lower"):
        trainer.fit(model, DataLoader(separable_data(32, 0), batch_size=8))
    assert trainer.global_step == 2  # the NaN step was not applied
    assert all(torch.isfinite(p).all() for p in model.classifier.parameters())


def test_a_wrong_prefix_lists_the_checkpoints_backbones_before_training(tmp_path):
    # BYOL holds its student under backbone. and its EMA teacher under teacher_backbone.
    from ssl_lightning.methods import BYOL
    from ssl_lightning.testing.trainer_runs import PrecomputedViews

    byol = BYOL(SmallConvNet((8, 16), norm="group"), projection_hidden_dim=16, projection_dim=8,
                optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
    trainer = tiny_trainer(max_steps=1)
    trainer.fit(byol, DataLoader(PrecomputedViews(8, (8, 8)), batch_size=4))
    path = str(tmp_path / "byol.ckpt")
    trainer.save_checkpoint(path)
    backbones = r"Its backbones are under 'backbone\.', 'teacher_backbone\.'"
    for prefix, hint in [("teacher.", ""), ("teacher_backbone", "Did you mean 'teacher_backbone.'"),
                         ("student_backbone.", "Did you mean 'teacher_backbone.'")]:
        with pytest.raises(ValueError, match=rf"no weights under '{prefix}'.*{hint}.*{backbones}"):
            LinearEval(None, NUM_CLASSES, checkpoint=path, checkpoint_prefix=prefix)
    teacher = LinearEval(None, NUM_CLASSES, checkpoint=path, checkpoint_prefix="teacher_backbone.")
    for key, value in byol.teacher_backbone.state_dict().items():
        assert torch.equal(teacher.backbone.state_dict()[key], value), key


def test_num_classes_other_than_the_datas_fails_before_training(tiny_image_folder):
    from ssl_lightning.data import ImageFolderDataModule

    data = ImageFolderDataModule(str(tiny_image_folder / "train"),
                                 str(tiny_image_folder / "test"), preset="cifar", batch_size=4,
                                 num_workers=0)
    model = LinearEval(SmallConvNet((8, 16)), 10, checkpoint="random")  # linear.yaml's CIFAR 10
    with pytest.raises(ValueError, match=r"num_classes=10, but the data \(ImageFolderDataModule"
                                         r"\) has 2 classes: pass --model.num_classes 2"):
        tiny_trainer(max_steps=1).fit(model, datamodule=data)
