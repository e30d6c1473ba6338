"""The slow tier is marked on the tests themselves, and a test that starts a process cannot sit
in the fast tier: tests/slow_tier.py (hooks of tests/conftest.py) fails it unless it is
marked ``slow``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow  # the inner session starts a Python process

TESTS = Path(__file__).resolve().parents[1]

INNER = '''
import subprocess
import sys

import pytest

SUBPROCESS = [sys.executable, "-c", "pass"]


def test_unmarked_subprocess():
    subprocess.run(SUBPROCESS, check=True)


@pytest.mark.slow
def test_marked_subprocess():
    subprocess.run(SUBPROCESS, check=True)


def test_unmarked_other_program():
    subprocess.run(["true"], check=True)


@pytest.fixture
def started():
    subprocess.run(SUBPROCESS, check=True)


def test_unmarked_fixture_subprocess(started):
    pass
'''


def test_a_process_start_fails_an_unmarked_test(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    for name in ("test_unmarked_subprocess", "test_unmarked_fixture_subprocess"):
        result.stdout.fnmatch_lines([f"*::{name} starts processes but is not marked slow*"])


def test_no_test_file_lists_paths_for_the_slow_tier() -> None:
    conftest = (TESTS / "conftest.py").read_text()
    assert "SLOW_FOLDERS" not in conftest and "SLOW_FILES" not in conftest
