"""Files are data, never code: hostile checkpoints and state-dict files through every entry point.

- a pickle whose ``__reduce__`` writes a marker file is refused (and does not run) by ``embed``,
  ``export``, ``LinearEval``, ``KNNEval``, ``--ckpt_path``, ``--model.checkpoint`` and
  ``pretrained_path``;
- a clean file whose ``backbone_spec.class_path`` names a function (``subprocess.run``,
  ``os.system``, ``builtins.eval``, a non-model function inside an allowed package) is refused
  with the way to allow a class; the allow-list and its extensions admit what they should;
- ``.safetensors`` files load as ``pretrained_path``;
- truncated, empty and text files get one line naming the file, the cause and the fix.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from jsonargparse import Namespace
from torch import nn

from ssl_lightning.backbones import SmallConvNet, build_backbone
from ssl_lightning.backbones import spec as spec_module
from ssl_lightning.backbones.spec import TRUSTED_CLASSES_ENV, config_class_paths, trust_classes
from ssl_lightning.cli import main as cli_main
from ssl_lightning.evaluation import KNNEval, LinearEval

ROOT = Path(__file__).resolve().parents[2]
SMALL_WIDTHS = (8, 16)


class Payload:
    """Unpickles by calling ``exec``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


class TinyNet(nn.Module):
    """A user backbone outside the built-in packages."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(3, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mean(dim=(2, 3)))


def _save_checkpoint(path: Path, backbone: nn.Module, spec: dict, **extra: object) -> str:
    state = {f"backbone.{k}": v for k, v in backbone.state_dict().items()}
    torch.save({"state_dict": state, "backbone_spec": spec, **extra}, path)
    return str(path)


def _small_spec() -> tuple[nn.Module, dict]:
    backbone = SmallConvNet(SMALL_WIDTHS)
    return backbone, dict(backbone.backbone_spec)  # type: ignore[arg-type]


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "payload_ran"


@pytest.fixture
def malicious_checkpoint(tmp_path: Path, marker: Path) -> str:
    """A working SmallConvNet checkpoint whose hyperparameters pickle the payload."""
    backbone, spec = _small_spec()
    return _save_checkpoint(tmp_path / "malicious.ckpt", backbone, spec,
                            hyper_parameters={"lr": 0.1, "note": Payload(marker)})


@pytest.fixture
def images(tmp_path: Path, make_image_folder) -> Path:
    return make_image_folder(tmp_path / "images", classes=1, per_class=2, size=16)


def _embed(ckpt: str, tmp_path: Path, images: Path) -> None:
    cli_main(["embed", "--checkpoint", ckpt, "--images", str(images),
              "--output", str(tmp_path / "features.npy")])


def _export(ckpt: str, tmp_path: Path, images: Path) -> None:
    cli_main(["export", "--checkpoint", ckpt, "--format", "torchscript",  # rebuilds the backbone
              "--output", str(tmp_path / "traced.pt"), "--image-size", "16"])


def _linear(ckpt: str, tmp_path: Path, images: Path) -> None:
    LinearEval(num_classes=2, checkpoint=ckpt)


def _knn(ckpt: str, tmp_path: Path, images: Path) -> None:
    KNNEval(checkpoint=ckpt)


ENTRY_POINTS: dict[str, Callable[[str, Path, Path], None]] = {
    "embed": _embed, "export": _export, "LinearEval": _linear, "KNNEval": _knn}


def _refusal(run: Callable[[], None], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line message ``run`` fails with (a ``SystemExit`` prints it on stderr)."""
    with pytest.raises((SystemExit, ValueError)) as info:
        run()
    message = str(info.value) if isinstance(info.value, ValueError) else capsys.readouterr().err
    assert "Traceback" not in message
    return message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_malicious_pickle_is_refused_and_does_not_run(entry, malicious_checkpoint, marker,
                                                       tmp_path, images, capsys) -> None:
    message = _refusal(lambda: ENTRY_POINTS[entry](malicious_checkpoint, tmp_path, images),
                       capsys)
    assert not marker.exists()
    assert malicious_checkpoint in message
    assert "refused: it pickles the Python object exec " in message and "could run code" in message


@pytest.mark.parametrize("flag", ["--ckpt_path", "--model.checkpoint"])
def test_a_malicious_pickle_is_refused_by_the_cli(flag, malicious_checkpoint, marker, run_config,
                                                  capsys) -> None:
    config = "simclr.yaml" if flag == "--ckpt_path" else "linear.yaml"
    extra = ["--model.backbone", "SmallConvNet", "--model.backbone.widths", "[8, 16]"]
    with pytest.raises(SystemExit):
        run_config(ROOT / "configs" / config, [flag, malicious_checkpoint,
                                               *(extra if flag == "--ckpt_path" else [])])
    err = capsys.readouterr().err
    assert not marker.exists()
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert malicious_checkpoint in line and "refused" in line and "could run code" in line
    assert "Traceback" not in err


def test_a_malicious_pretrained_path_is_refused(tmp_path, marker) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"state_dict": SmallConvNet(SMALL_WIDTHS).state_dict(), "x": Payload(marker)},
               path)
    with pytest.raises(ValueError, match=r"pretrained_path .*weights\.pt' is refused"):
        SmallConvNet(SMALL_WIDTHS, pretrained_path=str(path))
    assert not marker.exists()


HOSTILE_SPECS = {
    "subprocess.run": lambda m: {"args": [sys.executable, "-c", f"open({str(m)!r}, 'w')"]},
    "os.system": lambda m: {"command": f'"{sys.executable}" -c "open({str(m)!r}, \'w\')"'},
    "builtins.eval": lambda m: {},
    "torchvision.models.get_model": lambda m: {"name": "resnet18"},  # allowed package, no model
    "ssl_lightning.backbones.spec.build_backbone": lambda m: {"spec": {}},
    "ssl_lightning.__main__.main": lambda m: {},  # importing it would run the CLI
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("class_path", list(HOSTILE_SPECS))
def test_a_hostile_class_path_is_refused(entry, class_path, marker, tmp_path, images,
                                         capsys) -> None:
    backbone, _ = _small_spec()
    spec = {"class_path": class_path, "init_args": HOSTILE_SPECS[class_path](marker)}
    ckpt = _save_checkpoint(tmp_path / "hostile.ckpt", backbone, spec)
    message = _refusal(lambda: ENTRY_POINTS[entry](ckpt, tmp_path, images), capsys)
    assert not marker.exists()
    assert ckpt in message and f"{class_path!r}" in message and "not on the allow-list" in message
    assert f"{TRUSTED_CLASSES_ENV}={class_path}" in message


@pytest.mark.parametrize("class_path, init_args", [
    ("ssl_lightning.backbones.small.SmallConvNet", {"widths": [4]}),
    ("ssl_lightning.SmallConvNet", {"widths": [4]}),
    ("torchvision.models.resnet18", {"num_classes": 3}),
    ("torchvision.models.squeezenet.SqueezeNet", {"num_classes": 3}),
    ("timm.models.resnet.resnet18", {"num_classes": 0}),
])
def test_built_in_models_are_allowed(class_path, init_args) -> None:
    if class_path.startswith("timm"):
        pytest.importorskip("timm")
    assert isinstance(build_backbone({"class_path": class_path, "init_args": init_args}),
                      nn.Module)


def test_a_user_class_is_allowed_by_name_by_package_or_from_the_config(monkeypatch) -> None:
    monkeypatch.setattr(spec_module, "_trusted", set())
    spec = {"class_path": f"{__name__}.TinyNet", "init_args": {"width": 5}}
    with pytest.raises(ValueError, match=rf"{TRUSTED_CLASSES_ENV}={__name__}\.TinyNet"):
        build_backbone(spec)
    for value in (f"{__name__}.TinyNet", f"other.Net, {__name__}.*"):
        monkeypatch.setenv(TRUSTED_CLASSES_ENV, value)
        assert isinstance(build_backbone(spec), TinyNet)
    monkeypatch.delenv(TRUSTED_CLASSES_ENV)
    config = Namespace(model=Namespace(class_path="ssl_lightning.LinearEval", init_args=Namespace(
        backbone={"class_path": f"{__name__}.TinyNet"})), trainer={"callbacks": [
            {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint"}]})
    assert sorted(config_class_paths(config)) == [
        "pytorch_lightning.callbacks.ModelCheckpoint", "ssl_lightning.LinearEval",
        f"{__name__}.TinyNet"]
    trust_classes(config_class_paths(config))
    assert build_backbone(spec).linear.out_features == 5


def test_a_user_class_checkpoint_goes_through_linear_eval_when_trusted(tmp_path, monkeypatch):
    monkeypatch.setattr(spec_module, "_trusted", set())
    backbone = TinyNet(6)
    ckpt = _save_checkpoint(tmp_path / "user.ckpt", backbone,
                            {"class_path": f"{__name__}.TinyNet", "init_args": {"width": 6}})
    with pytest.raises(ValueError, match="not on the allow-list"):
        LinearEval(num_classes=2, checkpoint=ckpt)
    monkeypatch.setenv(TRUSTED_CLASSES_ENV, f"{__name__}.TinyNet")
    model = LinearEval(num_classes=2, checkpoint=ckpt)
    assert torch.equal(model.backbone.linear.weight, backbone.linear.weight)


def test_safetensors_pretrained_path_loads_the_weights(tmp_path) -> None:
    source = SmallConvNet(SMALL_WIDTHS)
    path = tmp_path / "weights.safetensors"
    safetensors.torch.save_file(source.state_dict(), str(path))
    loaded = SmallConvNet(SMALL_WIDTHS, pretrained_path=str(path))
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"weights\.safetensors' cannot be read .*not a "
                                         r"complete safetensors file.*\.safetensors"):
        SmallConvNet(SMALL_WIDTHS, pretrained_path=str(path))


def _damaged(path: Path, kind: str) -> str:
    """``path`` rewritten as a truncated copy of a real torch file, an empty or a text file."""
    if kind == "truncated":
        backbone, spec = _small_spec()
        _save_checkpoint(path, backbone, spec)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_text("" if kind == "empty" else "epochs: 12\nlr: 0.1\n")
    return str(path)


CAUSES = {"truncated": "the archive is incomplete or corrupt",
          "empty": "is empty (0 bytes)", "text": "not a file written by torch.save"}


@pytest.mark.parametrize("flag, kind", [  # truncated / empty --ckpt_path: test_cli_resume.py
    *[(flag, kind) for flag in ("--model.checkpoint", "--model.backbone.pretrained_path")
      for kind in CAUSES], ("--ckpt_path", "text")])
def test_a_damaged_file_is_one_line_naming_file_cause_and_fix(flag, kind, run_config, tmp_path,
                                                              capsys) -> None:
    bad = _damaged(tmp_path / "bad.pt", kind)
    config, extra = "linear.yaml", [flag, bad]
    if flag != "--model.checkpoint":
        config = "simclr.yaml"
        extra = ["--model.backbone", "SmallConvNet", "--model.backbone.widths", "[8, 16]", *extra]
    with pytest.raises(SystemExit):
        run_config(ROOT / "configs" / config, extra)
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert bad in line and CAUSES[kind] in line
    fix = "Resume from the previous checkpoint" if flag == "--ckpt_path" else (
        "Pass a state-dict file" if "pretrained" in flag else "Pass a .ckpt written by")
    assert fix in line
    for raw in ("Traceback", "PytorchStreamReader", "invalid literal", "KeyError", "OSError"):
        assert raw not in err


def test_checkpoints_written_by_fit_load_with_weights_only(run_config, tmp_path) -> None:
    """Every file ``fit`` writes (last, best, the periodic ones; hyperparameters, callback and
    loader states, the backbone spec) is plain data, so the safe load needs no exceptions."""
    run_config(ROOT / "configs" / "simclr.yaml", [
        "--model.backbone", "SmallConvNet", "--model.backbone.widths", "[8, 16]",
        "--trainer.fast_dev_run", "false", "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "1"])
    written = sorted(tmp_path.glob("runs/**/*.ckpt"))
    assert written
    for path in written:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        assert {"state_dict", "backbone_spec", "callbacks", "hyper_parameters"} <= set(checkpoint)


def _package_trust_cases(marker: Path, tmp_path: Path, images: Path) -> dict[str, tuple]:
    """(trusted package, hostile spec, what it would leave behind if called)."""
    pickled = tmp_path / "weights.pth"
    torch.save({"x": Payload(marker)}, pickled)
    return {
        "timm load_state_dict": ("timm.*", {"class_path": "timm.models.load_state_dict",
                                            "init_args": {"checkpoint_path": str(pickled),
                                                          "weights_only": False}},
                                 marker),
        "ssl_lightning write_shards": ("ssl_lightning.*", {
            "class_path": "ssl_lightning.data.shards.write_shards",
            "init_args": {"images": str(images), "output": str(tmp_path / "copied")}},
            tmp_path / "copied"),
    }


@pytest.mark.parametrize("case", ["timm load_state_dict", "ssl_lightning write_shards"])
def test_a_trusted_package_admits_only_its_module_classes(case, marker, tmp_path, images,
                                                          monkeypatch) -> None:
    """``SSL_LIGHTNING_TRUSTED_CLASSES='pkg.*'`` admits nn.Module classes only; a function of
    the package is refused before it is called."""
    if case.startswith("timm"):
        pytest.importorskip("timm")
    package, spec, trace = _package_trust_cases(marker, tmp_path, images)[case]
    monkeypatch.setattr(spec_module, "_trusted", set())
    monkeypatch.setenv(TRUSTED_CLASSES_ENV, package)
    with pytest.raises(ValueError, match="not an nn.Module class, so it is not called") as info:
        build_backbone(spec)
    assert not trace.exists(), f"{spec['class_path']} was called"
    assert f"{TRUSTED_CLASSES_ENV}={spec['class_path']}" in str(info.value)
    assert isinstance(build_backbone({"class_path": "ssl_lightning.backbones.SmallConvNet",
                                      "init_args": {"widths": [4]}}), nn.Module)


def test_a_trusted_package_admits_no_private_module(monkeypatch) -> None:
    """``ssl_lightning.*`` does not admit ``ssl_lightning.__main__.main`` (importing it would
    run the CLI); a private name is admitted only when named exactly."""
    monkeypatch.setattr(spec_module, "_trusted", set())
    monkeypatch.setenv(TRUSTED_CLASSES_ENV, "ssl_lightning.*")
    monkeypatch.delitem(sys.modules, "ssl_lightning.__main__", raising=False)
    with pytest.raises(ValueError, match="not on the allow-list"):
        build_backbone({"class_path": "ssl_lightning.__main__.main", "init_args": {}})
    assert "ssl_lightning.__main__" not in sys.modules
