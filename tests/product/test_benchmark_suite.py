"""The speed table of the README and docs/performance.md is the benchmark suite's output, and
every suite benchmark still runs (on tiny sizes; no timings are checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import suite  # noqa: E402


@pytest.mark.parametrize("page", suite.PAGES, ids=lambda page: page.name)
def test_the_pages_speed_table_is_the_suites_results(page: Path) -> None:
    table = suite.readme_table(page.read_text())
    assert table == (ROOT / "benchmarks" / "results.md").read_text()
    rows = json.loads((ROOT / "benchmarks" / "results.json").read_text())["rows"]
    assert {row["benchmark"].split(",")[0] for row in rows} == set(suite.BENCHMARKS)
    for row in rows:  # the Markdown is the JSON's numbers
        assert f"| {row['benchmark']} | {row['variant']} | {row['value']:.3g} | {row['unit']} | " \
            f"{row['ratio']:.2f}× |" in table


@pytest.mark.slow
def test_every_benchmark_runs_in_tiny_mode(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--tiny", "--output",
                    str(tmp_path)], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {row["benchmark"].split(",")[0] for row in rows} == set(suite.BENCHMARKS)
    for row in rows:  # every variant measured, against a reference of the same benchmark
        assert row["value"] > 0 and row["ratio"] > 0, row
        assert any(r["variant"] == row["reference"] and r["benchmark"] == row["benchmark"]
                   for r in rows), row
