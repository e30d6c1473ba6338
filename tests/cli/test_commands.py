"""The one map of subcommands (``ssl_lightning.cli.commands.COMMANDS``): every command in it
answers ``--help``, dispatch reads it, and the commands beside LightningCLI's take kebab-case
flags only (docs/cli.md says why)."""

from __future__ import annotations

import re

import pytest

from ssl_lightning.cli import main
from ssl_lightning.cli.commands import COMMANDS, Command

#: A flag in a help text (``--batch-size``, ``--model.lr``).
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*(?:\.[\w-]+)*")


def _help(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0, name
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_of_the_map_answers_help(name: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(name, capsys)
    assert text.startswith("usage:") and name in text.splitlines()[0], text[:200]
    if COMMANDS[name].target is not None:
        assert not [flag for flag in FLAG.findall(text) if "_" in flag or "." in flag], (
            f"{name}: flags not in kebab-case: {FLAG.findall(text)}")


def test_dispatch_runs_what_the_map_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(COMMANDS, "count", Command("count", "ARGS...", "count the arguments",
                                                   "builtins:len"))
    assert main(["count", "a", "b", "c"]) == 3


@pytest.mark.parametrize("columns", ["60", "71", "80", "97", "120"])
def test_the_help_text_lists_the_map_in_its_order(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  columns: str) -> None:
    """At any terminal width (the wrapping also depends on the configs folder's path): a
    command name such as ``channel-stats`` is never split at its hyphen."""
    monkeypatch.setenv("COLUMNS", columns)
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    positions = [text.find(f"{name} (`{name} ") for name in COMMANDS]
    assert -1 not in positions and positions == sorted(positions), positions
