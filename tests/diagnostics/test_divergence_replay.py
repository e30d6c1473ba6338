"""A run made to diverge on purpose is captured and its step replayed exactly
(``DivergenceCapture`` + ``python -m ssl_lightning replay``, docs/reliability.md).

Tiny SimCLR runs through the real CLI (24 images of 32 px, batch 4, CPU): a learning rate that
overflows the weights at a known step, a poisoned image whose views are NaN, a loss spike
(``spike_factor``) for a capture with a finite loss and its gradients, and the known-bad
variant: views drawn from a generator the sample seeds do not drive, which the replay check
must catch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml
from PIL import Image

from ssl_lightning.cli import main
from ssl_lightning.cli.replay import replay
from ssl_lightning.data.transforms import SimCLRViews
from ssl_lightning.io import capture as files

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 2
  logger: false
  enable_checkpointing: false
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
model:
  class_path: SimCLR
  init_args:
    backbone:
      class_path: SmallConvNet
      init_args: {widths: [8, 16]}
    projection_hidden_dim: 16
    projection_dim: 8
    optimizer: sgd
    lr: 0.1
    lr_scaling: none
    warmup_epochs: 0
data:
  class_path: ImageFolderDataModule
  init_args: {batch_size: 4, num_workers: 0, preset: cifar}
"""

MAGENTA = (255, 0, 255)


class LrOverflow(pl.Callback):
    """Sets the learning rate to ``lr`` for the update of global step ``step``."""

    def __init__(self, step: int = 2, lr: float = 1e12) -> None:
        self.step, self.lr = step, lr

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            for group in optimizer.param_groups:
                group["lr"] = self.lr


class InfGradient(pl.Callback):
    """Puts an inf into one gradient of global step ``step`` (a finite loss, then an overflow
    in the backward pass)."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.view(-1)[0] = math.inf


class PoisonedViews(SimCLRViews):
    """SimCLR views, NaN for a magenta image (a decoder gone wrong on one file)."""

    def __call__(self, image):
        views = super().__call__(image)
        if image.convert("RGB").getpixel((0, 0)) == MAGENTA:
            views = [torch.full_like(v, math.nan) for v in views]
        return views


class NumpyNoiseViews(SimCLRViews):
    """Known-bad: noise from NumPy's global generator, which the sample seeds do not drive."""

    def __call__(self, image):
        return [v + torch.from_numpy(np.random.rand(*v.shape)).float() for v in
                super().__call__(image)]


def fit_until_diverged(root: Path, images: Path, *, callbacks=(), transform: str | None = None,
                       capture_args: dict | None = None, model: dict | None = None) -> Path:
    """Run the CLI in ``root`` until it stops on divergence; the capture folder."""
    config = yaml.safe_load(CONFIG)
    if model is not None:
        config["model"] = model
    config["data"]["init_args"]["train_dir"] = str(images)
    if transform is not None:
        config["data"]["init_args"]["train_transform"] = {
            "class_path": f"{__name__}.{transform}", "init_args": {"preset": "cifar"}}
    config["trainer"]["callbacks"] = [{"class_path": f"{__name__}.{c}"} for c in callbacks]
    if capture_args is not None:
        config["trainer"]["callbacks"].append(
            {"class_path": "DivergenceCapture", "init_args": capture_args})
    root.mkdir(parents=True, exist_ok=True)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        with pytest.raises(SystemExit) as stopped:
            main(["fit", "--config", str(path)])
    assert stopped.value.code == 1
    captures = sorted((root / files.CAPTURES_DIR).glob("step-*"))
    assert len(captures) == 1, captures
    return captures[0]


@pytest.fixture(scope="module")
def overflow(tmp_path_factory, tiny_image_folder) -> Path:
    """Step 2's update with lr 1e12 leaves huge (finite) weights; step 3's forward overflows."""
    return fit_until_diverged(tmp_path_factory.mktemp("overflow"), tiny_image_folder / "train",
                              callbacks=["LrOverflow"])


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, tiny_image_folder) -> tuple[Path, Path]:
    """(capture, poisoned file): one magenta image among the 24, whose views are NaN."""
    root = tmp_path_factory.mktemp("poisoned")
    images = root / "images"
    shutil.copytree(tiny_image_folder / "train", images)
    poison = images / "class_1" / "poison.png"
    Image.new("RGB", (32, 32), MAGENTA).save(poison)
    return fit_until_diverged(root / "run", images, transform="PoisonedViews"), poison


SPIKE = {"spike_factor": 1e-6, "spike_min_steps": 2}  # any loss after 2 steps is a "spike"


@pytest.fixture(scope="module")
def spike(tmp_path_factory, tiny_image_folder) -> Path:
    """A capture of a finite step with its gradients (the spike check at global step 2)."""
    return fit_until_diverged(tmp_path_factory.mktemp("spike"), tiny_image_folder / "train",
                              capture_args=SPIKE)


def test_lr_overflow_is_captured_before_the_step(overflow) -> None:
    manifest = json.loads((overflow / files.MANIFEST).read_text())
    assert manifest["step"] == {"epoch": 0, "batch": 3, "global_step": 3}
    assert "the loss is nan" in manifest["reason"]
    assert manifest["exact"] and not manifest["gradients"]
    assert sorted(manifest["files"]) == sorted(
        p.name for p in overflow.iterdir())  # every file listed, nothing else
    for name in manifest["files"]:
        path = overflow / name
        if name.endswith(".json"):
            json.loads(path.read_text(), parse_constant=pytest.fail)  # strict: no NaN
        elif name.endswith((".pt", ".ckpt")):
            torch.load(path, weights_only=True)
    rank = json.loads((overflow / "rank-0.json").read_text())
    assert len(rank["sample_seeds"]) == len(rank["dataset_indices"]) == 4
    assert rank["loss"] == "nan"  # strict JSON: the exact tensor is in rank-0.pt
    assert torch.isnan(torch.load(overflow / "rank-0.pt", weights_only=True)["loss"])
    assert not list(overflow.parent.glob(".*"))  # no temporary folder left


def test_lr_overflow_replays_bit_exactly_and_names_the_module(overflow) -> None:
    report = replay(overflow)
    assert report.same_samples and report.loss_equal and report.reproduced
    # backbone.net: conv, GroupNorm, ReLU, conv, GroupNorm...: the huge weights overflow the
    # statistics of the second convolution's group norm (the convolution's output is finite)
    assert report.first_nonfinite_output == "backbone.net.4"
    assert report.schedules["learning rate"] == [pytest.approx(0.0853553, rel=1e-5)]
    assert len(report.image_paths) == 4


def test_float64_replay_tells_numerics_from_data(overflow, poisoned) -> None:
    numerics = replay(overflow, precision="64-true")
    assert numerics.loss is not None and torch.isfinite(numerics.loss)
    assert numerics.first_nonfinite_output is None and numerics.loss_equal is None
    assert "not compared: replayed in 64-true, the run used 32-true" in numerics.text()
    data = replay(poisoned[0], precision="64-true")
    assert data.first_nonfinite_output == "backbone.net.0"


def test_poisoned_image_is_named_in_the_replay(poisoned) -> None:
    capture, poison = poisoned
    report = replay(capture)
    assert report.reproduced
    assert report.first_nonfinite_output == "backbone.net.0"  # the first layer sees NaN views
    assert str(poison) in report.image_paths


def test_spike_capture_replays_loss_and_gradients_bit_exactly(spike) -> None:
    manifest = json.loads((spike / files.MANIFEST).read_text())
    assert manifest["step"]["global_step"] == 2 and manifest["gradients"]
    report = replay(spike)
    assert torch.isfinite(report.loss)
    assert report.loss_equal and report.gradients_equal and report.gradient_difference == 0
    assert report.terms["train/loss"] == float(report.loss)


def test_queue_and_teacher_are_restored_as_the_step_found_them(tmp_path,
                                                               tiny_image_folder) -> None:
    """MoCo v2 enqueues the step's keys during the step: the capture keeps the queue of before
    (a copy of the buffers at each batch start), or the replayed loss would differ."""
    model = {"class_path": "MoCoV2", "init_args": {
        "backbone": {"class_path": "SmallConvNet", "init_args": {"widths": [8, 16]}},
        "projection_hidden_dim": 16, "projection_dim": 8, "queue_size": 16, "lr": 0.1,
        "warmup_epochs": 0, "lr_scaling": "none"}}
    capture = fit_until_diverged(tmp_path, tiny_image_folder / "train", capture_args=SPIKE,
                                 model=model)
    report = replay(capture)
    assert report.loss_equal and report.gradients_equal and report.reproduced
    assert any(name.startswith("EMA momentum") for name in report.schedules)


def test_a_nonfinite_gradient_stops_before_the_update_with_its_gradients(tmp_path,
                                                                        tiny_image_folder) -> None:
    capture = fit_until_diverged(tmp_path, tiny_image_folder / "train", callbacks=["InfGradient"])
    manifest = json.loads((capture / files.MANIFEST).read_text())
    assert manifest["step"]["global_step"] == 1 and manifest["gradients"]
    assert "a gradient is not finite" in manifest["reason"]
    gradients = torch.load(capture / files.GRADIENTS, weights_only=True)
    assert sum(int(torch.isinf(g).sum()) for g in gradients.values()) == 1
    state = torch.load(capture / files.STATE, weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert torch.isfinite(torch.load(capture / "rank-0.pt", weights_only=True)["loss"])


def test_a_run_below_the_spike_factor_writes_no_capture(tmp_path, tiny_image_folder) -> None:
    config = yaml.safe_load(CONFIG)
    config["data"]["init_args"]["train_dir"] = str(tiny_image_folder / "train")
    config["trainer"]["callbacks"] = [{"class_path": "DivergenceCapture", "init_args": {
        "spike_factor": 10.0, "spike_min_steps": 2}}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        cli = main(["fit", "--config", str(path)])
    assert cli.trainer.global_step == 12 and not (tmp_path / files.CAPTURES_DIR).exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"spike_factor": 0.0}, "spike_factor must be > 0"),
    ({"spike_window": 0}, "spike_window and spike_min_steps must be >= 1"),
])
def test_capture_arguments_are_checked(kwargs, message) -> None:
    from ssl_lightning.callbacks import DivergenceCapture

    with pytest.raises(ValueError, match=message):
        DivergenceCapture(**kwargs)


def test_views_drawn_without_the_sample_seeds_fail_the_replay_check(tmp_path,
                                                                     tiny_image_folder) -> None:
    capture = fit_until_diverged(tmp_path, tiny_image_folder / "train",
                                 transform="NumpyNoiseViews", capture_args=SPIKE)
    report = replay(capture)
    assert report.same_samples  # the same images ...
    assert report.loss_equal is False and report.gradients_equal is False  # ... other views
    assert not report.reproduced
    assert "THE REPLAY DIFFERS FROM THE CAPTURED STEP" in report.text()


def test_replay_command_prints_the_report_and_writes_the_views(spike, tmp_path,
                                                               capsys) -> None:
    views = tmp_path / "views"
    main(["replay", str(spike), "--dump-views", str(views)])
    out = capsys.readouterr().out
    assert "loss: captured" in out and "-> equal" in out and "Schedules at this step" in out
    assert sorted(p.name for p in views.iterdir()) == [
        f"sample{i:03d}_view{v}.png" for i in range(4) for v in range(2)]


@pytest.mark.parametrize(("make", "expected"), [
    (lambda capture, tmp: tmp, "holds no manifest.json"),
    (lambda capture, tmp: tmp / "missing", "is not a folder"),
])
def test_replay_of_a_folder_that_is_no_capture_is_one_error_line(spike, tmp_path, capsys, make,
                                                                  expected) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(make(spike, tmp_path))])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1


def test_replay_with_a_config_that_cannot_be_built_is_one_error_line(spike, tmp_path,
                                                                     capsys) -> None:
    config = yaml.safe_load((spike / files.CONFIG).read_text())
    config["model"]["class_path"] = "NoSuchMethod"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(spike), "--config", str(broken)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the config's model or data cannot be built") and \
        "NoSuchMethod" in err


@pytest.mark.parametrize(("args", "expected"), [
    (["--devices", "2"], "error: --devices 2: a replay runs on one process"),
    (["--precision", "banana"], "error: --precision banana / --accelerator cpu: Precision "),
])
def test_replay_options_it_cannot_run_are_one_error_line(spike, capsys, args, expected) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(spike), *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1


def test_replay_without_the_data_says_so(spike, tmp_path, capsys) -> None:
    config = yaml.safe_load((spike / files.CONFIG).read_text())
    config["data"]["init_args"]["train_dir"] = str(tmp_path / "moved")
    moved = tmp_path / "moved.yaml"
    moved.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(spike), "--config", str(moved)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the training data of the run cannot be read" in err and "moved" in err


def _fit_ddp(rank: int, world: int, config: str) -> int:
    """A pool job: the CLI run on this rank of the DDP group; its exit code."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    try:
        main(["fit", "--config", config])
    except SystemExit as exited:
        return int(exited.code or 0)
    return 0


@pytest.mark.slow
def test_ddp_capture_replays_on_one_process_with_the_global_batch(tmp_path,
                                                                  tiny_image_folder) -> None:
    from distributed_utils import run_in_processes

    config = yaml.safe_load(CONFIG)
    config["trainer"].update(devices=2, strategy="ddp", precision="64-true",
                             default_root_dir=str(tmp_path))
    # 2 processes = 1 process needs no per-rank batch statistics (SyncBatchNorm needs GPUs)
    config["model"]["init_args"]["head_batch_norm"] = False
    config["trainer"]["callbacks"] = [{"class_path": "DivergenceCapture", "init_args": SPIKE}]
    config["data"]["init_args"]["train_dir"] = str(tiny_image_folder / "train")
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(config))
    assert run_in_processes(_fit_ddp, 2, str(path)) == [1, 1]  # both ranks stopped
    (capture,) = (tmp_path / files.CAPTURES_DIR).glob("step-*")
    manifest = json.loads((capture / files.MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["step"]["global_step"] == 2
    ranks = [json.loads((capture / f"rank-{r}.json").read_text()) for r in range(2)]
    assert not set(ranks[0]["dataset_indices"]) & set(ranks[1]["dataset_indices"])
    report = replay(capture)  # --devices 1: the global batch of 8 on one process
    assert report.same_samples and len(report.image_paths) == 8
    assert report.loss_equal and report.gradients_equal  # to 1e-6 relative
    assert report.gradient_difference < 1e-12
