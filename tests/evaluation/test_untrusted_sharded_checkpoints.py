"""Sharded checkpoint directories are data: hostile, damaged and misplaced ones through every
entry point that reads a directory (``consolidate``, ``embed``, ``export``, ``LinearEval`` /
``KNNEval --model.checkpoint``, ``fit --ckpt_path``).

A real directory is written once by a 1-process ``ShardedStrategy`` fit (SimCLR, SmallConvNet);
each test damages a copy of it:

- a ``.metadata`` that pickles a command and then returns the genuine metadata, and a byte item
  that pickles one, are refused with one line, and the command does not run;
- a missing or truncated shard, a truncated ``.metadata``, a directory without ``meta.pt``: one
  ``error:`` line naming the file and the cause;
- ``consolidate`` refuses an output inside its source and an existing file (``--overwrite``
  replaces it); a sharded directory resumed without the sharded strategy names
  ``configs/shared/fsdp.yaml``.
"""

from __future__ import annotations

import builtins
import operator
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ssl_lightning.cli import main as cli_main
from ssl_lightning.io.distributed_checkpoint import METADATA_FILE, read_metadata

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model.backbone", "SmallConvNet", "--model.backbone.widths", "[8, 16]"]


class _Command:
    """Unpickles by calling ``exec``: a command a hostile file runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


class _CommandThenGenuine:
    """Unpickles by running :class:`_Command`, then returns the genuine ``value``."""

    def __init__(self, marker: Path, value: object) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return operator.getitem, ((_Command(self.marker), self.value), 1)


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory, tiny_image_folder: Path) -> Path:
    """A sharded checkpoint directory written by one step of a 1-process ``ShardedStrategy``."""
    run = tmp_path_factory.mktemp("sharded_run")
    started = dist.is_initialized()
    cli_main(["fit", "--config", str(ROOT / "configs" / "simclr.yaml"),
              "--config", str(ROOT / "configs" / "shared" / "fsdp.yaml"),
              "--data.root", str(tiny_image_folder), "--data.batch_size", "4",
              "--data.num_workers", "0", "--trainer.accelerator", "cpu",
              "--trainer.devices", "1", "--trainer.max_steps", "1",
              "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run),
              *SMALL])
    if dist.is_initialized() and not started:  # the strategy's 1-process group
        dist.destroy_process_group()
    path = run / "checkpoints" / "last.ckpt"
    assert path.is_dir() and (path / METADATA_FILE).is_file()
    return path


@pytest.fixture
def copy(genuine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(genuine, tmp_path / "last.ckpt"))


@pytest.fixture
def images(tiny_image_folder: Path) -> Path:
    return tiny_image_folder / "test"


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "payload_ran"


def _consolidate(path: Path, tmp_path: Path, images: Path) -> None:
    cli_main(["consolidate", str(path), str(tmp_path / "consolidated.ckpt")])


def _embed(path: Path, tmp_path: Path, images: Path) -> None:
    cli_main(["embed", "--checkpoint", str(path), "--images", str(images),
              "--output", str(tmp_path / "features.npy")])


def _export(path: Path, tmp_path: Path, images: Path) -> None:
    cli_main(["export", "--checkpoint", str(path), "--format", "torchscript",
              "--output", str(tmp_path / "traced.pt"), "--image-size", "16"])


ENTRY_POINTS: dict[str, Callable[[Path, Path, Path], None]] = {
    "consolidate": _consolidate, "embed": _embed, "export": _export}
#: CLI entry points run on a config: (config, subcommand, extra arguments before the path flag).
CONFIG_ENTRY_POINTS = {
    "LinearEval --model.checkpoint": ("linear.yaml", "fit", ["--model.checkpoint"]),
    "KNNEval --model.checkpoint": ("knn.yaml", "validate", ["--model.checkpoint"]),
    "fit --ckpt_path": ("simclr.yaml", "fit", [*SMALL, "--ckpt_path"]),
}


def _error_line(run: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    """The one ``error:`` line ``run`` exits with; no traceback."""
    with pytest.raises(SystemExit) as info:
        run()
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    return line


def _entry(name: str, path: Path, tmp_path: Path, run_config,  # type: ignore[no-untyped-def]
           images: Path) -> Callable[[], object]:
    if name in ENTRY_POINTS:
        return lambda: ENTRY_POINTS[name](path, tmp_path, images)
    config, subcommand, extra = CONFIG_ENTRY_POINTS[name]
    return lambda: run_config(ROOT / "configs" / config, [*extra, str(path)],
                              subcommand=subcommand)


ALL_ENTRY_POINTS = [*ENTRY_POINTS, *CONFIG_ENTRY_POINTS]


@pytest.mark.parametrize("entry", ALL_ENTRY_POINTS)
def test_a_metadata_that_runs_a_command_is_refused(entry, copy, marker, tmp_path, run_config,
                                                   images, capsys) -> None:
    genuine_metadata = read_metadata(copy)
    (copy / METADATA_FILE).write_bytes(
        pickle.dumps(_CommandThenGenuine(marker, genuine_metadata)))
    line = _error_line(_entry(entry, copy, tmp_path, run_config, images), capsys)
    assert not marker.exists(), "the command in .metadata ran"
    assert str(copy) in line and METADATA_FILE in line and "is refused" in line
    assert "could run code" in line


def test_a_metadata_that_changes_an_admitted_function_is_refused(copy, tmp_path,
                                                                capsys) -> None:
    """A ``BUILD`` on an admitted global (torch's layout lookup) would change it for the whole
    process: refused before the attribute is set."""
    from torch import serialization

    (copy / METADATA_FILE).write_bytes(  # _get_layout.injected = {}; return _get_layout
        b"\x80\x02ctorch.serialization\n_get_layout\nN}X\x08\x00\x00\x00injected}s\x86b.")
    line = _error_line(lambda: _consolidate(copy, tmp_path, tmp_path), capsys)
    assert not hasattr(serialization._get_layout, "injected"), "the pickle changed _get_layout"
    assert "sets attributes of torch.serialization._get_layout" in line


def test_a_byte_item_that_runs_a_command_is_refused(copy, marker, tmp_path, capsys) -> None:
    """torch's planner reads non-tensor items with ``torch.load(weights_only=False)``."""
    import torch.distributed.checkpoint as dcp

    from ssl_lightning.distributed.sharding import load_sharded_checkpoint

    state = {"state_dict": dict(load_sharded_checkpoint(copy)["state_dict"])}
    state["state_dict"]["note"] = _Command(marker)
    for shard in copy.glob("*.distcp"):
        shard.unlink()
    dcp.save(state, checkpoint_id=copy, no_dist=True)
    line = _error_line(lambda: _consolidate(copy, tmp_path, tmp_path), capsys)
    assert not marker.exists(), "the command in a byte item ran"
    assert "'state_dict.note'" in line and "is refused" in line and "could run code" in line


def test_a_shard_named_outside_the_directory_is_refused(copy, tmp_path, capsys) -> None:
    """The shard names in ``.metadata`` are joined to the directory: ``../x`` must not be read
    (here a genuine shard waits there, so reading it would succeed)."""
    metadata = read_metadata(copy)
    for info in metadata.storage_data.values():
        info.relative_path = "../escaped.distcp"
    (copy / "__0_0.distcp").rename(tmp_path / "escaped.distcp")
    (copy / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    line = _error_line(lambda: _consolidate(copy, tmp_path, tmp_path), capsys)
    assert "'../escaped.distcp', which is not a file name inside the directory" in line
    assert not (tmp_path / "consolidated.ckpt").exists()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {  # what is done to the copy -> (the file named, the cause)
    "missing shard": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp", "is missing"),
    "truncated shard": (lambda d: _truncate(d / "__0_0.distcp"), "__0_0.distcp", "is truncated"),
    "truncated metadata": (lambda d: _truncate(d / METADATA_FILE), METADATA_FILE, "truncated"),
}


@pytest.mark.parametrize("entry", ["consolidate", "embed", "fit --ckpt_path"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_sharded_checkpoint_is_one_line(entry, damage, copy, tmp_path, run_config,
                                                  images, capsys) -> None:
    do, file, cause = DAMAGE[damage]
    do(copy)
    line = _error_line(_entry(entry, copy, tmp_path, run_config, images), capsys)
    assert str(copy) in line and file in line and cause in line


def test_a_directory_without_meta_pt_says_so(copy, tmp_path, images, capsys) -> None:
    (copy / "meta.pt").unlink()
    line = _error_line(lambda: _embed(copy, tmp_path, images), capsys)
    assert str(copy) in line and "without meta.pt" in line and "not found" not in line


def test_resuming_a_sharded_checkpoint_without_the_sharded_strategy_names_fsdp_yaml(
        copy, tmp_path, run_config, images, capsys) -> None:
    line = _error_line(_entry("fit --ckpt_path", copy, tmp_path, run_config, images), capsys)
    assert "is a sharded checkpoint" in line and "configs/shared/fsdp.yaml" in line
    assert "IsADirectoryError" not in line


@pytest.mark.parametrize("inside", ["__0_0.distcp", "meta.pt", "new.ckpt"])
def test_consolidate_refuses_an_output_inside_its_source(inside, copy, tmp_path, capsys) -> None:
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    line = _error_line(lambda: cli_main(["consolidate", str(copy), str(copy / inside)]), capsys)
    assert "is inside the checkpoint directory" in line
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before


def test_consolidate_replaces_an_existing_file_only_with_overwrite(copy, tmp_path,
                                                                  capsys) -> None:
    output = tmp_path / "existing.txt"
    output.write_text("not ours")
    line = _error_line(lambda: cli_main(["consolidate", str(copy), str(output)]), capsys)
    assert "exists" in line and "--overwrite" in line and output.read_text() == "not ours"
    cli_main(["consolidate", str(copy), str(output), "--overwrite"])
    consolidated = torch.load(output, weights_only=True)
    assert consolidated["global_step"] == 1 and "backbone.net.0.weight" in \
        consolidated["state_dict"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
