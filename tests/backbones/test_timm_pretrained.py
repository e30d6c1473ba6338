"""timm backbones train through the CLI (a ViT with DINO's multi-crop views without being told
``dynamic_img_size``); pretrained_path loads torchvision/timm/export files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from ssl_lightning.backbones import ResNet, SmallConvNet, TimmBackbone, TorchvisionBackbone, ViT

pytestmark = pytest.mark.slow

timm = pytest.importorskip("timm")
ROOT = Path(__file__).resolve().parents[2]

TIMM_MODELS = {
    "resnet18": {},
    "vit_tiny_patch16_224": {"img_size": 32, "patch_size": 4, "depth": 2},
    "convnext_atto": {},
}


# DINO's 16 px local crops are smaller than ConvNeXt's 32x downsampling: SimCLR only for it.
RUNS = [(name, "simclr.yaml") for name in sorted(TIMM_MODELS)] + [
    ("resnet18", "dino.yaml"), ("vit_tiny_patch16_224", "dino.yaml")]


@pytest.mark.parametrize("name, config", RUNS)
def test_timm_backbone_trains_two_steps_through_the_cli(run_config, name, config):
    kwargs = TIMM_MODELS[name]
    backbone = ["--model.init_args.backbone", "ssl_lightning.TimmBackbone",
                "--model.init_args.backbone.init_args.name", name]
    if kwargs:
        backbone += ["--model.init_args.backbone.init_args.model_kwargs", str(kwargs)]
    heads = (["--model.init_args.projection_hidden_dim", "32"] if config == "simclr.yaml" else
             ["--model.init_args.head_hidden_dim", "32", "--model.init_args.head_bottleneck_dim",
              "16", "--model.init_args.head_out_dim", "64"])
    cli = run_config(ROOT / "configs" / config,
                     [*backbone, *heads, "--trainer.fast_dev_run", "2"])
    assert cli.trainer.global_step == 2
    assert isinstance(cli.model.backbone, TimmBackbone)
    assert cli.model.backbone.net.default_cfg["architecture"] == name


TINY_VIT = {"img_size": 32, "patch_size": 4, "depth": 1}


def test_a_timm_vit_takes_every_crop_size_without_being_told():
    backbone = TimmBackbone("vit_tiny_patch16_224", model_kwargs=TINY_VIT).eval()
    with torch.no_grad():
        for size in (32, 16, 24):
            assert backbone(torch.randn(2, 3, size, size)).shape == (2, 192)


def test_dynamic_img_size_given_is_kept_and_a_fixed_size_model_refuses_other_sizes():
    fixed = TimmBackbone("vit_tiny_patch16_224", model_kwargs={**TINY_VIT,
                                                               "dynamic_img_size": False})
    assert fixed(torch.randn(2, 3, 32, 32)).shape == (2, 192)
    with pytest.raises(ValueError, match=r"'vit_tiny_patch16_224' takes only 32x32 images, got "
                                         r"16x16 .* Pass model_kwargs: \{dynamic_img_size: true\}"):
        fixed(torch.randn(2, 3, 16, 16))
    assert not hasattr(TimmBackbone("resnet18").net, "dynamic_img_size")


def test_a_fixed_size_vit_with_multi_crop_views_is_one_line_through_the_cli(run_config, capsys):
    kwargs = {**TIMM_MODELS["vit_tiny_patch16_224"], "dynamic_img_size": False}
    with pytest.raises(SystemExit) as exit_info:
        run_config(ROOT / "configs" / "dino.yaml", [
            "--model.backbone", "TimmBackbone", "--model.backbone.name", "vit_tiny_patch16_224",
            "--model.backbone.model_kwargs", str(kwargs), "--model.head_hidden_dim", "32",
            "--model.head_bottleneck_dim", "16", "--model.head_out_dim", "64"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    err = err.splitlines()
    assert err[-1].startswith("error: ImageSizeError: TimmBackbone 'vit_tiny_patch16_224' takes "
                              "only 32x32 images, got 16x16"), err[-1]


def test_unknown_timm_name_suggests_close_names():
    with pytest.raises(ValueError, match="Did you mean 'resnet18'"):
        TimmBackbone("resnet81")


def _features(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module.eval()(x)


def test_pretrained_path_loads_a_torchvision_state_dict(tmp_path):
    source = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(source.state_dict(), path)  # as torchvision code saves it (with the fc layer)
    x = torch.randn(2, 3, 64, 64)
    source.fc = nn.Identity()
    expected = _features(source, x)
    for backbone in (ResNet(18, pretrained_path=str(path)),
                     TorchvisionBackbone("resnet18", pretrained_path=str(path))):
        torch.testing.assert_close(_features(backbone, x), expected, rtol=0, atol=0)


def test_pretrained_path_loads_a_timm_state_dict_and_our_exports(tmp_path):
    source = timm.create_model("resnet18", num_classes=10)
    path = tmp_path / "timm.pth"
    torch.save(source.state_dict(), path)
    source.reset_classifier(0)
    x = torch.randn(2, 3, 32, 32)
    loaded = TimmBackbone("resnet18", pretrained_path=str(path))
    torch.testing.assert_close(_features(loaded, x), _features(source, x), rtol=0, atol=0)
    for make in (lambda p: SmallConvNet((8, 16), pretrained_path=p),
                 lambda p: ViT(depth=1, embed_dim=32, num_heads=2, pretrained_path=p)):
        original = make(None)
        export = tmp_path / "export.pt"
        torch.save(original.state_dict(), export)  # what `export --format state_dict` writes
        torch.testing.assert_close(_features(make(str(export)), x), _features(original, x))


def test_pretrained_file_of_another_architecture_names_the_first_bad_key(tmp_path):
    path = tmp_path / "r50.pth"
    torch.save(torchvision.models.resnet50().state_dict(), path)
    with pytest.raises(ValueError, match=r"'conv1.weight'|'layer1.0.conv1.weight'|missing"):
        ResNet(18, pretrained_path=str(path))
    torch.save(torchvision.models.resnet18().state_dict(), path)
    with pytest.raises(ValueError, match="first missing key 'net.0.weight'"):
        SmallConvNet(pretrained_path=str(path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ViT(pretrained_path=str(tmp_path / "nothing.pt"))


def test_timm_drop_paths_are_ours_keyed_by_sample_and_off_in_the_dino_teacher():
    from ssl_lightning.backbones.vit import DropPath
    from ssl_lightning.methods import DINO
    from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward

    torch.manual_seed(0)
    backbone = TimmBackbone("vit_tiny_patch16_224", model_kwargs={
        "img_size": 16, "patch_size": 4, "embed_dim": 16, "depth": 2, "num_heads": 2,
        "drop_path_rate": 0.5}).double().train()
    drops = [m for m in backbone.modules() if isinstance(m, DropPath)]
    assert len(drops) == 2 and not any(isinstance(m, timm.layers.DropPath)
                                       for m in backbone.modules())
    x, seeds = torch.randn(6, 3, 16, 16, dtype=torch.float64), torch.arange(6) * 977 + 5

    def features(rows: list[int]) -> torch.Tensor:
        with torch.no_grad(), keyed_forward(SampleKeys.from_seeds(seeds[rows], 0, 0, 1, 0)):
            return backbone(x[rows])

    whole = features(list(range(6)))
    torch.testing.assert_close(features([4, 1]), whole[[4, 1]], atol=1e-12, rtol=0)
    dino = DINO(backbone, head_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4)
    assert all(m.drop_prob == 0 for m in dino.teacher_backbone.modules()
               if isinstance(m, DropPath))
