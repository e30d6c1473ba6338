"""Export: weights load into plain torchvision ResNets and give the checkpoint's features."""

from __future__ import annotations

import pytest
import torch
import torchvision
from evaluation_helpers import simclr_checkpoint
from torch import nn

from ssl_lightning.backbones import ResNet, SmallConvNet
from ssl_lightning.evaluation.export import main, torchvision_resnet_recipe


def fake_checkpoint(backbone: nn.Module, path: str) -> None:
    """A Lightning-style checkpoint holding ``backbone.*`` weights (no training needed)."""
    state = {f"backbone.{k}": v for k, v in backbone.state_dict().items()}
    torch.save({"state_dict": state, "pytorch-lightning_version": "2.6.6"}, path)


def test_cifar_resnet18_export_loads_into_plain_torchvision(tmp_path, capsys):
    ckpt, out = str(tmp_path / "simclr.ckpt"), str(tmp_path / "r18.pt")
    simclr = simclr_checkpoint(ResNet(18, cifar_stem=True), ckpt, view_size=8, steps=1)
    main(["--checkpoint", ckpt, "--output", out])
    state = torch.load(out, weights_only=True)
    assert not any(k.startswith(("backbone.", "net.", "fc.")) for k in state)

    model = torchvision.models.resnet18()
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model.fc = nn.Identity()
    model.load_state_dict(state)  # strict
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = simclr.backbone.eval()(x)
        torch.testing.assert_close(model.eval()(x), expected, rtol=0, atol=1e-6)
        # the printed recipe builds the same model
        recipe = capsys.readouterr().out.split("Load it with:\n")[1]
        scope: dict = {"state": state}
        exec(recipe.replace(f'torch.load("{out}")', "state"), scope)
        torch.testing.assert_close(scope["model"].eval()(x), expected, rtol=0, atol=1e-6)

    plain = torchvision.models.resnet18()  # the ImageNet stem does not fit: a clear mismatch
    plain.fc = nn.Identity()
    with pytest.raises(RuntimeError, match="conv1.weight"):
        plain.load_state_dict(state)


@pytest.mark.parametrize("depth, norm", [(50, "batch"), (18, "group")])
def test_recipe_for_other_resnets(tmp_path, depth, norm):
    backbone = ResNet(depth, norm=norm)
    ckpt, out = str(tmp_path / "m.ckpt"), str(tmp_path / "r.pt")
    fake_checkpoint(backbone, ckpt)
    state = main(["--checkpoint", ckpt, "--output", out])
    recipe = torchvision_resnet_recipe(state)
    assert f"resnet{depth}(" in recipe and "CIFAR" not in recipe
    assert ("GroupNorm" in recipe) == (norm == "group")
    scope: dict = {}
    exec(recipe, scope)
    scope["model"].load_state_dict(torch.load(out, weights_only=True))


def test_backbone_format_loads_into_the_configured_class(tmp_path):
    backbone = SmallConvNet((8, 16))
    ckpt, out = str(tmp_path / "m.ckpt"), str(tmp_path / "b.pt")
    fake_checkpoint(backbone, ckpt)
    with pytest.raises(ValueError, match="--format backbone"):
        main(["--checkpoint", ckpt, "--output", out])
    main(["--checkpoint", ckpt, "--output", out, "--format", "backbone"])
    fresh = SmallConvNet((8, 16))
    fresh.load_state_dict(torch.load(out, weights_only=True))
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(fresh(x), backbone(x), rtol=0, atol=0)
