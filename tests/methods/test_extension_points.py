"""Extension points of a method: the ``build_criterion`` hook, heads injected as modules (from
Python and from a config). ``--model.help`` of every method:
``tests/properties/test_model_help.py``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import Tensor, nn

from ssl_lightning import BYOL, DCL, IBOT, SimCLR, SmallConvNet, VICReg, ViT
from ssl_lightning.cli import main
from ssl_lightning.losses import DCLLoss, DINOLoss

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = [8, 16]  # SmallConvNet(widths=WIDTHS) has 16 features


class MeanSquaredViews(nn.Module):
    """A stand-in loss: the mean squared difference of the two views' embeddings."""

    def forward(self, z1: Tensor, z2: Tensor, *gathered: object) -> Tensor:
        return (z1 - z2).pow(2).mean()


def test_a_subclass_changes_the_loss_by_overriding_build_criterion() -> None:
    class SquaredSimCLR(SimCLR):
        def build_criterion(self) -> nn.Module:
            return MeanSquaredViews()

    model = SquaredSimCLR(SmallConvNet(widths=WIDTHS), projection_hidden_dim=8, projection_dim=4)
    assert isinstance(model.criterion, MeanSquaredViews)
    views = [torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)]
    loss, _ = model.training_loss(views)
    z1, z2 = model.projector(model.backbone(torch.cat(views))).chunk(2)
    assert torch.allclose(loss, (z1 - z2).pow(2).mean())


def test_dcl_and_ibot_build_their_loss_through_the_hook() -> None:
    dcl = DCL(SmallConvNet(widths=WIDTHS), projection_hidden_dim=8, projection_dim=4,
              temperature=0.3, weight_sigma=0.5)
    assert isinstance(dcl.criterion, DCLLoss) and dcl.criterion.weight_sigma == 0.5
    assert dcl.criterion.temperature == 0.3
    vit = ViT(image_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, mask_token=True)
    ibot = IBOT(vit, head_out_dim=32, head_hidden_dim=16, head_bottleneck_dim=8,
                centering="sinkhorn", sinkhorn_iterations=5)
    assert isinstance(ibot.criterion, DINOLoss)
    assert (ibot.criterion.centering, ibot.criterion.sinkhorn_iterations) == ("sinkhorn", 5)


def test_the_base_class_builds_the_criterion_after_every_init() -> None:
    class WeightedSimCLR(SimCLR):
        def __init__(self, backbone: nn.Module, loss_weight: float = 2.0, **kwargs: Any) -> None:
            super().__init__(backbone, **kwargs)
            self.loss_weight = loss_weight  # set after SimCLR's __init__, read by the hook

        def build_criterion(self) -> nn.Module:
            return LossTimes(self.loss_weight)

    model = WeightedSimCLR(SmallConvNet(widths=WIDTHS), projection_hidden_dim=8,
                           projection_dim=4, loss_weight=3.0)
    assert isinstance(model.criterion, LossTimes) and model.criterion.weight == 3.0


class LossTimes(nn.Module):
    """A stand-in loss module holding a weight."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight = weight


def test_no_method_assigns_its_criterion_but_through_the_hook() -> None:
    for path in sorted((ROOT / "ssl_lightning" / "methods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(ast.unparse(t) == "self.criterion" for t in targets):
                    assert node.value is not None
                    assert ast.unparse(node.value) == "self.build_criterion()", (
                        f"{path.name}:{node.lineno}: {ast.unparse(node)}")


def test_injected_heads_are_used_and_copied_for_the_teacher() -> None:
    projector, predictor = nn.Linear(16, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = BYOL(SmallConvNet(widths=WIDTHS), projection_dim=4, projector=projector,
                 predictor=predictor)
    assert model.projector is projector and model.predictor is predictor
    assert isinstance(model.teacher_projector, nn.Linear)
    assert torch.equal(model.teacher_projector.weight, projector.weight)
    assert "projector" not in model.hparams and "predictor" not in model.hparams


def test_vicreg_takes_an_injected_expander() -> None:
    expander = nn.Linear(16, 4)
    model = VICReg(SmallConvNet(widths=WIDTHS), expander_dim=4, expander=expander)
    assert model.expander is expander and "expander" not in model.hparams
    loss, _ = model.training_loss([torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)])
    assert loss.isfinite()
    with pytest.raises(ValueError, match=r"expander Linear maps .*expander_dim=2048"):
        VICReg(SmallConvNet(widths=WIDTHS), expander=expander)


def test_an_injected_head_of_another_width_is_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"projector Linear maps .*projection_dim=128"):
        SimCLR(SmallConvNet(widths=WIDTHS), projector=nn.Linear(16, 32))
    with pytest.raises(ValueError, match="does not run on"):
        SimCLR(SmallConvNet(widths=WIDTHS), projector=nn.Linear(8, 128))
    with pytest.raises(TypeError, match="projector must be an nn.Module instance"):
        SimCLR(SmallConvNet(widths=WIDTHS), projector=nn.Linear)  # type: ignore[arg-type]


def test_a_config_injects_a_projector_by_class_path(
    tmp_path: Path, tiny_image_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "limit_val_batches": 0},
        "model": {"class_path": "SimCLR", "init_args": {
            "backbone": {"class_path": "SmallConvNet", "init_args": {"widths": WIDTHS}},
            "projection_dim": 8,
            "projector": {"class_path": "torch.nn.Linear",
                          "init_args": {"in_features": 16, "out_features": 8}},
            "optimizer": "sgd", "lr": 0.1, "lr_scaling": "none", "warmup_epochs": 0}},
        "data": {"class_path": "CIFAR10DataModule", "init_args": {
            "root": str(tiny_image_folder), "batch_size": 4, "num_workers": 0}},
    }
    path = tmp_path / "injected.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = main(["fit", "--config", str(path)])
    assert type(cli.model.projector) is nn.Linear and cli.model.projector.out_features == 8
    assert cli.trainer.global_step == 1
