"""Exit status of finished 2-process runs, repeated: a finished run must exit 0 every time.

Usage:
    python benchmarks/ddp_exit_repeat.py --config configs/moco_v2.yaml --runs 20
    python benchmarks/ddp_exit_repeat.py --strategy ddp --runs 20

Each run is ``python -m ssl_lightning fit`` on the config as shipped, shrunk to seconds on CPU
(``tests/product_matrix.py``: small backbone and heads, a tiny image folder, 2 steps per epoch,
2 epochs, validation every epoch, 2 processes on gloo). Prints one line per run (exit status,
seconds, the last line of stderr when it failed) and the counts of each status.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import _write_images  # noqa: E402  (the tests' tiny image folders)
from product_matrix import shrink_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/moco_v2.yaml")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--strategy", default="ddp_spawn", choices=["ddp_spawn", "ddp"])
    args = parser.parse_args()
    config = (ROOT / args.config).resolve()
    counts: collections.Counter[int] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        _write_images(data / "train", classes=2, per_class=12, size=32, seed=0)
        _write_images(data / "test", classes=2, per_class=6, size=32, seed=1)
        command = [sys.executable, "-m", "ssl_lightning", "fit", "--config", str(config),
                   *shrink_args(config, data, world_size=2), "--trainer.strategy", args.strategy]
        for run in range(args.runs):
            workdir = Path(tmp) / f"run{run}"
            workdir.mkdir()
            start = time.monotonic()
            result = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
            counts[result.returncode] += 1
            tail = "" if result.returncode == 0 else " | " + (
                result.stderr.strip().splitlines() or [""])[-1][:200]
            print(f"run {run}: exit {result.returncode} in {time.monotonic() - start:.1f} s{tail}",
                  flush=True)
    print(f"{args.config} {args.strategy}: " + ", ".join(
        f"exit {code}: {n}" for code, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
