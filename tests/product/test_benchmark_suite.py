"""The speed table of the README and docs/performance.md is the benchmark suite's output, and
every suite benchmark still runs (on tiny sizes; no timings are checked)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow  # the gradient-caching variants start a process each (their own peak memory)
def test_every_benchmark_runs_in_tiny_mode(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/suite.py --tiny`` run in this process (its main, as the command line runs
    it), writing its table to ``tmp_path``."""
    monkeypatch.setattr(sys, "argv", ["suite.py", "--tiny", "--output", str(tmp_path)])
    monkeypatch.setenv("PYTHONPATH",
                       os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        suite.main()
    finally:  # the benchmarks set one intra-op thread
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {row["benchmark"].split(",")[0] for row in rows} == set(suite.BENCHMARKS)
    for row in rows:  # every variant measured, against a reference of the same benchmark
        assert row["value"] > 0 and row["ratio"] > 0, row
        assert any(r["variant"] == row["reference"] and r["benchmark"] == row["benchmark"]
                   for r in rows), row
