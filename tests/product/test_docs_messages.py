"""The messages the docs quote are the package's: a quoted error or warning whose wording left the
code fails here.

Every backticked message the README, CONTRIBUTING.md or a page of ``docs/`` quotes (a span
starting with ``error: ``, or a long span on a line about an error, a warning or a refusal) is
checked statically: its clauses must be clauses of string literals in ``ssl_lightning/``, so
what is left is values (names, numbers, paths), ``...`` and ``<placeholders>``, never a run of
words. The most-read messages (the unknown-name lists of ``docs/cli.md``) are checked against
the text the code produces, which the static check cannot see (the names a message lists).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest
import pytorch_lightning as pl

from ssl_lightning.cli import resolve_config_names
from ssl_lightning.cli.errors import (
    automatic_option_message,
    class_arguments,
    suggestion_message,
    unknown_class_message,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")
CODE_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
#: A line that introduces a quoted message.
MESSAGE_LINE = re.compile(r"error|warn|refus|raise|message|prints|logs|says", re.IGNORECASE)
#: Clause boundaries: a message is compared clause by clause.
CLAUSE_BREAK = re.compile(r"[.;:,()?!`]")
#: What is not compared: an elision and a placeholder.
ELIDED = re.compile(r"\.\.\.|<[^>]*>")
#: A word of prose: four letters or more, not part of a path, a file or dotted name, a quoted
#: value, an identifier or a ``key: value`` pair (values such as ``sgd`` or ``float`` are words
#: too, so a word the code puts in from a value is not prose).
PROSE = re.compile(r"(?<![\w./'=(-])[a-z]{4,}(?![\w/'=(-]|\.\w|: ?[\d'\[])")
#: Words that the quoted messages show as values the code puts in (``read as float data``).
VALUES = frozenset({"float"})
#: Message text of other libraries that ours quote or pass on (jsonargparse, Pillow, the OS,
#: torch's FSDP2 warning about view outputs).
FOREIGN_TEXT = re.compile(r"Expected a typing\.Literal\[[^\]]*\]|Got value: \S+"
                          r"|cannot identify image file|No space left on device"
                          r"|FSDP2-wrapped module .*wrong gradients")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def quoted_messages(text: str) -> Iterator[str]:
    """The backticked messages of a page (outside code blocks; a span may wrap lines):
    ``error: ...`` spans, and spans of six words or more starting with a word or an option on
    lines about an error, a warning or a refusal."""
    text = CODE_BLOCK.sub("", text)
    for match in CODE_SPAN.finditer(text):
        span = _one_line(re.sub(r"\n\s*>", " ", match.group(1)).replace("\\|", "|"))
        lines = text[text.rfind("\n", 0, match.start()) + 1:text.find("\n", match.end())]
        if span.startswith(("error: ", "... ")) or (
                len(span.split()) >= 6 and MESSAGE_LINE.search(lines)
                and (span[0].isalpha() or span.startswith("--"))
                and not span.startswith("python")):
            yield span


@cache
def source_clauses() -> tuple[dict[str, set[int]], list[set[str]]]:
    """The clauses of every string literal of the package (an f-string's literal parts are one
    literal): the clauses of two words or more -> the literals holding them, and each literal's
    one-word clauses."""
    literals: set[str] = set()
    for path in (ROOT / "ssl_lightning").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                literals.add("`".join(_one_line(part.value) if isinstance(part, ast.Constant)
                                      else "" for part in node.values))  # a value ends a clause
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(_one_line(node.value))
    clauses: dict[str, set[int]] = {}
    words: list[set[str]] = []
    for number, literal in enumerate(sorted(literals)):
        parts = {part.strip() for part in CLAUSE_BREAK.split(literal)}
        for part in parts:
            if len(part.split()) >= 2:
                clauses.setdefault(part, set()).add(number)
        words.append({part for part in parts if re.fullmatch(r"[\w=>-]+", part)})
    return clauses, words


def unmatched_prose(message: str) -> list[str]:
    """The words of ``message`` that no literal of the package covers: covered are the clauses of
    two words or more of any literal, then the one-word clauses (``holds``) of the literals
    found that way."""
    text = ELIDED.sub("\0", message.removeprefix("error: "))
    text = FOREIGN_TEXT.sub("\0", text)
    clauses, words = source_clauses()
    covered = [False] * len(text)
    found: set[int] = set()
    for clause in sorted(clauses, key=len, reverse=True):
        start = text.find(clause)
        if start >= 0:
            found |= clauses[clause]
        while start >= 0:
            covered[start:start + len(clause)] = [True] * len(clause)
            start = text.find(clause, start + 1)
    single = sorted(set().union(*(words[number] for number in found)), key=len, reverse=True)
    if single:
        for match in re.finditer(rf"(?<!\w)(?:{'|'.join(map(re.escape, single))})(?!\w)", text):
            covered[match.start():match.end()] = [True] * (match.end() - match.start())
    return [match.group(0) for match in PROSE.finditer(text)
            if not any(covered[match.start():match.end()]) and match.group(0) not in VALUES]


def trainer_arguments() -> list[str]:
    return sorted(set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"})


def unknown_config_message(name: str) -> str:
    """What ``--config NAME`` prints for a name that is neither a file nor a shipped config."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), pytest.raises(SystemExit):
        resolve_config_names(["fit", "--config", name])
    return printed.getvalue().strip().removeprefix("error: ")


#: docs/cli.md's messages checked against the text the code produces (the start of the quote ->
#: the message), because they list names or put words in values, which the static check skips.
PRODUCED: dict[str, Callable[[], str]] = {
    "error: --model: unknown class 'SimCRL'": lambda: unknown_class_message("model", "SimCRL"),
    "error: --data: unknown class": lambda: unknown_class_message("data", "CIFAR10DataModul"),
    "error: --model.backbone: unknown class":
        lambda: unknown_class_message("model.backbone", "SmallConvNett"),
    "... Did you mean 'pytorch_lightning.callbacks.ModelCheckpoint'":
        lambda: unknown_class_message("trainer.callbacks", "ModelCheckpont"),
    "error: --optimizer:": lambda: automatic_option_message("optimizer"),
    "error: --model (SimCLR): unknown argument": lambda: suggestion_message(
        "--model (SimCLR): ", "argument", "temprature", class_arguments("ssl_lightning.SimCLR"),
        "SimCLR"),
    "error: --config 'simclrr'": lambda: unknown_config_message("simclrr"),
    "error: --trainer: unknown argument": lambda: suggestion_message(
        "--trainer: ", "argument", "max_epoch", trainer_arguments(), "--trainer"),
}
MESSAGES = [(doc, message) for doc in DOCS for message in quoted_messages(doc.read_text())]
STATIC = [(doc, message) for doc, message in MESSAGES if not message.startswith(tuple(PRODUCED))]


def test_the_docs_quote_messages() -> None:
    pages = {doc.name for doc, _ in MESSAGES}
    assert {"cli.md", "data_and_recipes.md", "ibot_dinov2.md"} <= pages, pages
    assert len(MESSAGES) >= 30, len(MESSAGES)


@pytest.mark.parametrize(("doc", "message"), STATIC,
                         ids=[f"{doc.name}:{message[:40]}" for doc, message in STATIC])
def test_every_quoted_message_is_worded_as_in_the_code(doc: Path, message: str) -> None:
    unmatched = unmatched_prose(message)
    assert not unmatched, (f"{doc.name} quotes {message!r}, whose words {unmatched} are in no "
                           "string of ssl_lightning/: quote the message as the code words it")


def quoted_as(message: str, produced: str) -> bool:
    """``message`` (a quote with ``...`` for elided text and ``<placeholders>``) is
    ``produced``."""
    pattern = ".*?".join(re.escape(part) for part in ELIDED.split(message))
    return re.fullmatch(pattern, produced, re.DOTALL) is not None


def cli_page_message(start: str) -> str:
    """The message of docs/cli.md's error table that starts with ``start``."""
    found = [m for doc, m in MESSAGES if doc.name == "cli.md" and m.startswith(start)]
    assert len(found) == 1, f"docs/cli.md quotes {len(found)} messages starting {start!r}"
    return found[0].removeprefix("error: ")


@pytest.mark.parametrize("start", PRODUCED)
def test_the_name_listing_messages_are_quoted_as_the_code_prints_them(start: str) -> None:
    message, produced = cli_page_message(start), PRODUCED[start]()
    assert quoted_as(message, produced), (f"docs/cli.md quotes {message!r}; the code prints "
                                          f"{produced!r}")
