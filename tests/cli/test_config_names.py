"""``--config NAME`` resolves a shipped config (from ``ssl_lightning.cli.commands.CONFIGS_DIR``)
from any working directory; a file path keeps meaning that file; an unknown name lists the
shipped ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssl_lightning.cli import commands, main, resolve_config_names
from ssl_lightning.cli.commands import shipped_configs


def _printed_config(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory without a ``configs/`` folder."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize("form", [["--config", "simclr"], ["--config=simclr"],
                                  ["-c", "simclr.yaml"]])
def test_a_short_name_is_the_shipped_config(elsewhere, capsys, form) -> None:
    expected = _printed_config(capsys, "--config", str(commands.CONFIGS_DIR / "simclr.yaml"))
    assert "SimCLR" in expected
    assert _printed_config(capsys, *form) == expected


def test_names_are_looked_up_in_configs_dir(elsewhere, monkeypatch, tmp_path: Path) -> None:
    shipped = tmp_path / "packaged"
    shipped.mkdir()
    (shipped / "mine.yaml").write_text("seed_everything: 7\n")
    monkeypatch.setattr(commands, "CONFIGS_DIR", shipped)
    assert resolve_config_names(["fit", "--config", "mine", "--config=mine.yaml"]) == [
        "fit", "--config", str(shipped / "mine.yaml"), f"--config={shipped / 'mine.yaml'}"]


def test_an_existing_file_keeps_meaning_that_file(elsewhere) -> None:
    (elsewhere / "simclr").write_text("seed_everything: 7\n")
    (elsewhere / "configs").mkdir()
    (elsewhere / "configs" / "simclr.yaml").write_text("seed_everything: 8\n")
    argv = ["fit", "--config", "simclr", "-c", "configs/simclr.yaml",
            "--config", "{seed_everything: 9}"]
    assert resolve_config_names(argv) == argv


@pytest.mark.parametrize(("value", "suggestion"), [
    ("simclrr", " Did you mean 'simclr'?"), ("zzzz", ""),
    ("configs/simclr.yaml", " Did you mean 'simclr'?")])
def test_an_unknown_name_lists_the_shipped_configs(elsewhere, capsys, value, suggestion) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --config {value!r}: no such file in {elsewhere}, nor a "
                          f"shipped config of that name.{suggestion} Shipped configs "), err
    every = ", ".join(path.stem for path in shipped_configs())
    assert f"): {every}." in err, err


def test_every_listing_of_configs_reads_one_folder(monkeypatch, tmp_path: Path) -> None:
    """``--config NAME``, ``list configs``, ``pretrain``'s methods and ``--help`` all read the
    configs from ``commands.shipped_configs()``."""
    from ssl_lightning.cli.listing import config_rows
    from ssl_lightning.cli.pretrain import method_names

    shipped = tmp_path / "packaged"
    (shipped / "shared").mkdir(parents=True)
    (shipped / "mine.yaml").write_text("# Mine.\nmodel: {class_path: SimCLR}\n")
    (shipped / "linear.yaml").write_text("model: {class_path: LinearEval}\n")
    (shipped / "shared" / "piece.yaml").write_text("[]\n")
    monkeypatch.setattr(commands, "CONFIGS_DIR", shipped)
    assert commands.shipped_configs() == [shipped / "linear.yaml", shipped / "mine.yaml"]
    assert [name for name, _ in config_rows()] == ["linear.yaml", "mine.yaml"]
    assert method_names() == ["mine"]
    assert f"Configs ({shipped}): linear.yaml, mine.yaml." in commands.project_description()
    assert resolve_config_names(["fit", "--config", "mine"])[2] == str(shipped / "mine.yaml")


@pytest.mark.parametrize("piece", ["fsdp", "streaming"])
def test_a_shared_piece_is_named_from_any_folder(elsewhere, capsys, piece) -> None:
    path = commands.CONFIGS_DIR / "shared" / f"{piece}.yaml"
    assert resolve_config_names(["fit", "--config", "simclr", "--config", f"shared/{piece}",
                                 f"--config=shared/{piece}.yaml"])[4:] == [
        str(path), f"--config={path}"]
    expected = _printed_config(capsys, "--config", "simclr", "--config", str(path))
    assert _printed_config(capsys, "--config", "simclr", "--config", f"shared/{piece}") == expected


def test_a_piece_named_without_its_folder_is_suggested(elsewhere, capsys) -> None:
    with pytest.raises(SystemExit):
        resolve_config_names(["fit", "--config", "fsdp"])
    err = capsys.readouterr().err
    assert "Did you mean 'shared/fsdp'?" in err and "shared/streaming" in err


def test_list_configs_lists_the_shared_pieces(capsys) -> None:
    from ssl_lightning.cli.listing import config_rows

    names = [name for name, _ in config_rows()]
    assert {"shared/fsdp.yaml", "shared/streaming.yaml"} <= set(names)
    assert "shared/pretrain_callbacks.yaml" not in names  # the value of trainer.callbacks
