"""The files state what is true now; the history of the work items that changed them stays in
the commit messages. No file of the package, configs, tests, benchmarks or docs cites an issue
number (``issue 25``, ``#36``) or a work stop."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("ssl_lightning", "tests", "benchmarks", "docs", ".ci")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ""}
WORK_ITEM = re.compile(r"\bissues? #?\d+|(?<![\w&])#\d{1,4}\b|\bstop \d+", re.IGNORECASE)


def text_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "pyproject.toml"]
    for folder in FOLDERS:
        files += [path for path in sorted((ROOT / folder).rglob("*"))
                  if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts]
    return [path for path in files if path.is_file()]


def test_no_file_cites_a_work_item() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
             for path in text_files() if path != Path(__file__).resolve()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for match in WORK_ITEM.finditer(line)]
    assert not found, f"work-item history in files (say what is true now instead): {found}"
