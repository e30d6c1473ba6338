"""The README's speed table is the benchmark suite's output, and every suite benchmark still
runs (on tiny sizes; no timings are checked)."""

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


def test_readme_speed_table_is_the_suites_results() -> None:
    readme = suite.readme_table((ROOT / "README.md").read_text())
    assert readme == (ROOT / "benchmarks" / "results.md").read_text()
    rows = json.loads((ROOT / "benchmarks" / "results.json").read_text())["rows"]
    for row in rows:  # the Markdown is the JSON's numbers
        assert f"| {row['variant']} | {row['value']:.3g} | {row['unit']} | {row['ratio']:.2f}× |" \
            in readme


@pytest.mark.slow
def test_every_benchmark_runs_in_tiny_mode(tmp_path: Path) -> None:
    pytest.importorskip("lightly")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--tiny", "--output",
                    str(tmp_path)], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    benchmarks = {row["benchmark"].split(",")[0] for row in rows}
    assert benchmarks == {"nt_xent fwd+bwd", "dcl fwd+bwd", "2-view SimCLR views"}
    assert all(row["value"] > 0 for row in rows)
