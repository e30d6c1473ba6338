"""Export: weights load into plain torchvision ResNets and give the checkpoint's features."""

from __future__ import annotations

import pytest
import torch
import torchvision
from evaluation_helpers import simclr_checkpoint
from torch import nn

from ssl_lightning.backbones import ResNet, SmallConvNet
from ssl_lightning.evaluation.export import export_state_dict, main, torchvision_resnet_recipe


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
    state = export_state_dict(ckpt, out)
    recipe = torchvision_resnet_recipe(state)
    assert f"resnet{depth}(" in recipe and "CIFAR" not in recipe
    assert ("GroupNorm" in recipe) == (norm == "group")
    scope: dict = {}
    exec(recipe, scope)
    scope["model"].load_state_dict(torch.load(out, weights_only=True))


@pytest.mark.parametrize("cifar_stem", [True, False])
def test_recipe_keeps_the_input_channel_count(tmp_path, cifar_stem):
    """A 13-band ResNet's printed recipe builds a 13-channel stem: the lines load as printed."""
    backbone = ResNet(18, cifar_stem=cifar_stem, in_chans=13)
    ckpt, out = str(tmp_path / "m.ckpt"), str(tmp_path / "r.pt")
    fake_checkpoint(backbone, ckpt)
    state = export_state_dict(ckpt, out)
    scope: dict = {}
    exec(torchvision_resnet_recipe(state), scope)
    scope["model"].load_state_dict(torch.load(out, weights_only=True))
    x = torch.randn(2, 13, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(scope["model"].eval()(x), backbone.eval()(x), rtol=0, atol=1e-5)


def test_backbone_format_loads_into_the_configured_class(tmp_path, capsys):
    backbone = SmallConvNet((8, 16))
    ckpt, out = str(tmp_path / "m.ckpt"), str(tmp_path / "b.pt")
    fake_checkpoint(backbone, ckpt)
    with pytest.raises(SystemExit):
        main(["--checkpoint", ckpt, "--output", out, "--format", "torchvision"])
    assert "--format state_dict" in capsys.readouterr().err
    main(["--checkpoint", ckpt, "--output", out])  # auto: the class's own state dict
    fresh = SmallConvNet((8, 16))
    fresh.load_state_dict(torch.load(out, weights_only=True))
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(fresh(x), backbone(x), rtol=0, atol=0)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A real SimCLR checkpoint of a SmallConvNet (its backbone_spec recorded)."""
    path = str(tmp_path_factory.mktemp("export") / "small.ckpt")
    model = simclr_checkpoint(SmallConvNet((8, 16)), path, view_size=16, steps=1)
    return path, model.backbone.eval()


def test_onnx_export_matches_pytorch_in_onnxruntime(small_checkpoint, tmp_path, capsys):
    onnxruntime = pytest.importorskip("onnxruntime")
    ckpt, backbone = small_checkpoint
    out = str(tmp_path / "b.onnx")
    main(["--checkpoint", ckpt, "--format", "onnx", "--output", out, "--image-size", "16"])
    x = torch.randn(5, 3, 16, 16)  # another batch size than the trace's: dynamic axis
    scope = {"images_nchw_float32": x.numpy()}
    exec(capsys.readouterr().out.split("Load it with:\n")[1], scope)  # the printed lines
    assert isinstance(scope["session"], onnxruntime.InferenceSession)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(scope["features"]), backbone(x), rtol=0,
                                   atol=1e-4)


def test_torchscript_export_reloads_with_the_same_features(small_checkpoint, tmp_path, capsys):
    ckpt, backbone = small_checkpoint
    out = str(tmp_path / "b.pt")
    main(["--checkpoint", ckpt, "--format", "torchscript", "--output", out, "--image-size", "16"])
    x = torch.randn(3, 3, 16, 16)
    scope = {"images": x}
    exec(capsys.readouterr().out.split("Load it with:\n")[1], scope)  # the printed lines
    with torch.no_grad():
        torch.testing.assert_close(scope["features"], backbone(x), rtol=0, atol=1e-6)


class Untraceable(nn.Module):
    """A backbone that cannot be traced (as one with Python-side state would)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x):
        if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            raise RuntimeError("this module keeps Python state and cannot be traced")
        return self.linear(x.mean(dim=(2, 3)))


def _checkpoint_with_spec(path: str, module: nn.Module, class_path: str, **init_args) -> str:
    state = {f"backbone.{k}": v for k, v in module.state_dict().items()}
    torch.save({"state_dict": state,
                "backbone_spec": {"class_path": class_path, "init_args": init_args}}, path)
    return path


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_of_an_untraceable_backbone_is_a_clear_error(tmp_path, capsys, fmt, monkeypatch):
    monkeypatch.setenv("SSL_LIGHTNING_TRUSTED_CLASSES", f"{__name__}.Untraceable")
    ckpt = _checkpoint_with_spec(str(tmp_path / "m.ckpt"), Untraceable(),
                                 f"{__name__}.Untraceable")
    with pytest.raises(SystemExit):
        main(["--checkpoint", ckpt, "--format", fmt, "--output", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "cannot be" in err and "Untraceable" in err and "--format state_dict" in err


def test_export_of_a_checkpoint_whose_spec_does_not_fit_is_a_clear_error(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("SSL_LIGHTNING_TRUSTED_CLASSES", "torch.nn.Linear")
    out = str(tmp_path / "x.onnx")
    ckpt = _checkpoint_with_spec(str(tmp_path / "a.ckpt"), Untraceable(), "torch.nn.Linear")
    with pytest.raises(SystemExit):  # the spec cannot build (missing constructor arguments)
        main(["--checkpoint", ckpt, "--format", "onnx", "--output", out])
    assert "Cannot build the backbone torch.nn.Linear" in capsys.readouterr().err
    ckpt = _checkpoint_with_spec(str(tmp_path / "b.ckpt"), nn.Linear(3, 4), "torch.nn.Linear",
                                 in_features=3, out_features=7)
    with pytest.raises(SystemExit):  # it builds, but the weights do not fit: the key is named
        main(["--checkpoint", ckpt, "--format", "onnx", "--output", out])
    assert "mismatch for 'weight'" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["state_dict", "torchscript", "onnx"])
def test_an_output_that_is_the_checkpoint_is_refused(small_checkpoint, tmp_path, capsys, fmt):
    pytest.importorskip("onnxruntime")
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(open(small_checkpoint[0], "rb").read())
    (tmp_path / "link.ckpt").symlink_to(ckpt)
    (tmp_path / "sub").mkdir()
    before = ckpt.read_bytes()
    for output in (ckpt, tmp_path / "link.ckpt", tmp_path / "sub" / ".." / "last.ckpt"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--checkpoint", str(ckpt), "--format", fmt, "--output", str(output)])
        assert exit_info.value.code == 2
        assert "is the checkpoint" in capsys.readouterr().err
        assert ckpt.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "link.ckpt", "sub"]


def test_timm_format_refuses_backbones_that_are_not_timm_models(small_checkpoint, tmp_path,
                                                                capsys):
    resnet = _checkpoint_with_spec(str(tmp_path / "r.ckpt"), ResNet(18),
                                   "ssl_lightning.backbones.resnet.ResNet", depth=18)
    cases = [(small_checkpoint[0], "SmallConvNet", "state_dict, onnx, torchscript"),
             (resnet, "ResNet", "torchvision, state_dict, onnx, torchscript")]
    for ckpt, name, formats in cases:
        with pytest.raises(SystemExit):
            main(["--checkpoint", ckpt, "--format", "timm", "--output", str(tmp_path / "t.pt")])
        err = capsys.readouterr().err
        assert "needs a TimmBackbone" in err and name in err and f"fit: {formats}." in err
    assert not (tmp_path / "t.pt").exists()


def test_timm_export_loads_into_timm_with_the_printed_lines(tmp_path, capsys):
    pytest.importorskip("timm")
    from ssl_lightning.backbones import TimmBackbone

    backbone = TimmBackbone("resnet18").eval()
    ckpt = _checkpoint_with_spec(str(tmp_path / "m.ckpt"), backbone,
                                 "ssl_lightning.backbones.timm_models.TimmBackbone",
                                 name="resnet18", pretrained_path=None, model_kwargs=None)
    out = str(tmp_path / "timm.pt")
    main(["--checkpoint", ckpt, "--output", out])  # --format auto: timm for a timm model
    recipe = capsys.readouterr().out.split("Load it with:\n")[1]
    scope: dict = {}
    exec(recipe, scope)  # builds the timm model and loads the file strictly
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(scope["model"].eval()(x), backbone(x), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_a_failed_export_leaves_an_existing_output_as_it_was(tmp_path, capsys, monkeypatch, fmt):
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("SSL_LIGHTNING_TRUSTED_CLASSES", f"{__name__}.Untraceable")
    ckpt = _checkpoint_with_spec(str(tmp_path / "m.ckpt"), Untraceable(),
                                 f"{__name__}.Untraceable")
    out = tmp_path / "previous.bin"
    out.write_bytes(b"an earlier export")
    with pytest.raises(SystemExit):
        main(["--checkpoint", ckpt, "--format", fmt, "--output", str(out)])
    assert "cannot be" in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ckpt", "previous.bin"]


def test_the_default_format_follows_the_backbone(small_checkpoint, tmp_path, capsys):
    """``--format auto``: torchvision for a ResNet (the first test), timm for a timm model
    (above), the backbone class's own state dict for any other backbone."""
    ckpt, backbone = small_checkpoint
    out = str(tmp_path / "small.pt")
    main(["--checkpoint", ckpt, "--output", out])
    assert "backbone = SmallConvNet(widths=(8, 16)" in capsys.readouterr().out
    state = torch.load(out, weights_only=True)
    assert state.keys() == backbone.state_dict().keys()


def test_the_docs_format_table_names_the_commands_default(capsys):
    """docs/evaluation.md's ``--format`` table marks the default that ``export --help`` has
    (it said ``torchvision (default)`` once the default had become ``auto``)."""
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["--help"])
    default = capsys.readouterr().out.split("{", 1)[1].split("}", 1)[1]
    assert "auto (default)" in " ".join(default.split())
    page = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    marked = [line.split("|")[1].strip() for line in page.splitlines()
              if line.startswith("| `") and "(default)" in line.split("|")[1]]
    assert marked == ["`auto` (default)"]
