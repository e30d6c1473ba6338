"""The lists the docs keep by hand agree with the lists of the code: the commands (the CLI's
subcommand map, :data:`ssl_lightning.cli.commands.COMMANDS`), the shipped configs
(``configs/``), the test folders and the data modules' shared arguments. The lists of methods
are checked against the registry in ``tests/methods/test_registry.py`` (the README row, the
docs sections) and in ``tests/product/test_docs_messages.py`` (the unknown-method message); the
other pages name no full list of methods, they point to ``python -m ssl_lightning list
methods``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from ssl_lightning.cli.commands import COMMANDS, EXTRA_COMMANDS, project_description
from ssl_lightning.data.base import SSLDataModule
from ssl_lightning.data.transforms import SimCLRViews

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
COMMAND = re.compile(r"`([a-z][a-z-]*)`")
#: "N methods", "N configs", "the original nine": a count that the next method makes wrong.
COUNT_CLAIM = re.compile(r"(?<![\w-])(?:\d+|nine|ten|eleven|twelve|original \w+) (?:shipped )?"
                         r"(?:methods|configs|commands|subcommands)\b|the original \w+ follow",
                         re.IGNORECASE)


def paragraph(path: Path, start: str) -> str:
    """The paragraph of ``path`` that starts with ``start``."""
    text = path.read_text(encoding="utf-8")
    begin = text.find(start)
    assert begin >= 0, f"{path.name} has no paragraph starting {start!r}"
    end = text.find("\n\n", begin)
    return text[begin:end if end >= 0 else None]


def test_the_cli_page_table_is_the_subcommand_map() -> None:
    table = paragraph(ROOT / "docs" / "cli.md", "| command | what it does | page |")
    rows = {match.group(1): match.group(2)
            for match in re.finditer(r"^\| `([a-z-]+)` \| ([^|]+) \|", table, re.MULTILINE)}
    assert set(rows) == set(COMMANDS), (
        f"docs/cli.md's table of commands lacks {sorted(set(COMMANDS) - set(rows))} and names "
        f"{sorted(set(rows) - set(COMMANDS))}, which ssl_lightning.cli.commands.COMMANDS does "
        "not have")
    differ = {name: (text.strip(), COMMANDS[name].help) for name, text in rows.items()
              if text.strip() != COMMANDS[name].help}
    assert not differ, f"docs/cli.md's one-line help differs from COMMANDS: {differ}"


def test_the_layout_page_names_every_test_folder() -> None:
    entry = paragraph(ROOT / "docs" / "layout.md", "tests/  ")
    listed = set(re.findall(r"\b([a-z_]+)/", entry))
    folders = {path.name for path in (ROOT / "tests").iterdir()
               if path.is_dir() and path.name != "__pycache__" and not path.name.startswith(".")}
    assert folders <= listed, f"docs/layout.md's tests/ entry lacks {sorted(folders - listed)}"


def test_the_configs_page_names_every_shared_data_argument() -> None:
    text = paragraph(ROOT / "docs" / "configs.md", "Arguments shared by all (`SSLDataModule`)")
    arguments = set(inspect.signature(SSLDataModule.__init__).parameters) - {"self"}
    missing = sorted(name for name in arguments if f"`{name}`" not in text)
    assert not missing, f"docs/configs.md's SSLDataModule arguments lack {missing}"


def test_the_configs_page_gives_the_whole_signature_of_simclr_views() -> None:
    text = paragraph(ROOT / "docs" / "configs.md", "- `SimCLRViews(")
    signature = text[:text.index(")`:")]
    arguments = set(inspect.signature(SimCLRViews.__init__).parameters) - {"self"}
    missing = sorted(name for name in arguments if not re.search(rf"\b{name}\b", signature))
    assert not missing, f"docs/configs.md's SimCLRViews(...) lacks {missing}"


def test_the_help_text_names_every_command() -> None:
    commands = project_description().partition("Commands: ")[2]
    missing = [name for name in COMMANDS if not re.search(rf"\b{name} \(`", commands)]
    assert not missing, f"python -m ssl_lightning --help does not name {missing}"


def test_every_command_is_shown_in_use() -> None:
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in DOCS)
    missing = [name for name in EXTRA_COMMANDS if f"python -m ssl_lightning {name} " not in text]
    assert not missing, f"no page shows `python -m ssl_lightning <command> ...` for {missing}"


def test_every_shipped_config_is_named_in_the_docs() -> None:
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in DOCS)
    configs = sorted((ROOT / "configs").glob("*.yaml")) + sorted(
        (ROOT / "configs" / "shared").glob("*.yaml"))
    missing = [str(path.relative_to(ROOT)) for path in configs
               if path.name not in text and f"--config {path.stem}" not in text]
    assert not missing, f"shipped configs no page names: {missing}"


def test_no_page_counts_the_methods_configs_or_commands() -> None:
    claims = [f"{doc.name}: {match.group(0)!r}" for doc in DOCS
              for match in COUNT_CLAIM.finditer(doc.read_text(encoding="utf-8"))]
    assert not claims, (f"counts that the next method or config makes wrong: {claims}; point to "
                        "`python -m ssl_lightning list methods|configs` instead")
