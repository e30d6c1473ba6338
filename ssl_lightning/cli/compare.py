"""``python -m ssl_lightning compare runs/...``: a table of finished runs, and their curves.

Each argument is a run directory, a folder holding run directories at any depth, a
``results.json`` or a shell pattern (``'runs/*/version_0'``); a run directory is one that holds
``results.json`` (:mod:`ssl_lightning.io.results`). ``--plot out.png`` draws each metric's curve
of every run into one picture, read from the run's TensorBoard event files (TensorBoard's
``EventAccumulator``) or, without them, its CSV logger's ``metrics.csv``.
"""

from __future__ import annotations

import argparse
import csv
import glob
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ssl_lightning.callbacks.run_summary import REPORTED_METRICS
from ssl_lightning.io.atomic import atomic_path
from ssl_lightning.io.results import RESULTS_FILE, read_results

Curve = list[tuple[int, float]]
#: Curves drawn by ``--plot`` unless ``--metrics`` names others.
PLOTTED_METRICS = ("val/knn_top1", "train/loss")


def find_runs(patterns: Sequence[str]) -> tuple[list[Path], list[str]]:
    """The run directories named by ``patterns`` (sorted, each once), and one line per pattern
    that named none."""
    runs: dict[Path, None] = {}
    missing = []
    for pattern in patterns:
        paths = [Path(p) for p in sorted(glob.glob(pattern))] or [Path(pattern)]
        found = []
        for path in paths:
            if path.is_file() and path.name == RESULTS_FILE:
                found.append(path.parent)
            elif path.is_dir():
                found += sorted(r.parent for r in path.rglob(RESULTS_FILE) if r.is_file())
        if not found:
            where = "does not exist" if not any(p.exists() for p in paths) else \
                f"holds no {RESULTS_FILE} (it is written when a fit ends)"
            missing.append(f"{pattern}: {where}")
        runs.update(dict.fromkeys(found))
    return list(runs), missing


def table(runs: Sequence[Path], records: Sequence[dict[str, Any]],
          metrics: Sequence[str]) -> list[list[str]]:
    """Header and one row per run: where, method, backbone, data, step, then each metric as
    ``last (best)``."""
    rows = [["run", "method", "backbone", "data", "step", *metrics]]
    for run, record in zip(runs, records, strict=True):
        data = record.get("data") or {}
        values = record.get("metrics") or {}
        rows.append([str(run), str(record.get("method")), str(record.get("backbone")),
                     str(data.get("location") or data.get("class")), str(record.get("step")),
                     *(_metric_cell(values.get(name)) for name in metrics)])
    return rows


def _metric_cell(value: Any) -> str:
    if not isinstance(value, dict) or "last" not in value:
        return "-"
    last = float(value["last"])
    best = float(value["best"]) if "best" in value else last
    return f"{last:.4g}" + (f" ({best:.4g})" if best != last else "")


def _logged_name(name: str, logged: set[str]) -> str | None:
    """``name`` as the logger wrote it: a metric logged per step and per epoch is written as
    ``<name>_step`` and ``<name>_epoch``; the curve is the per-step one."""
    return next((n for n in (name, f"{name}_step", f"{name}_epoch") if n in logged), None)


def read_curves(run: Path, names: Sequence[str]) -> dict[str, Curve]:
    """``name -> [(step, value), ...]`` from the run's TensorBoard events, else ``metrics.csv``."""
    if any(run.glob("events.out.tfevents.*")):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run), size_guidance={"scalars": 0})
        events.Reload()
        tags = set(events.Tags().get("scalars", []))
        found = {name: _logged_name(name, tags) for name in names}
        return {name: [(e.step, float(e.value)) for e in events.Scalars(tag)]
                for name, tag in found.items() if tag is not None}
    curves: dict[str, Curve] = {}
    table_file = run / "metrics.csv"
    if table_file.is_file():
        with table_file.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            columns = {name: _logged_name(name, set(reader.fieldnames or ())) for name in names}
            for row in reader:
                for name, column in columns.items():
                    if column is not None and row.get(column) not in (None, ""):
                        curves.setdefault(name, []).append((int(row["step"]),
                                                            float(row[column])))
    return curves


def plot(runs: Sequence[Path], names: Sequence[str], output: Path) -> list[str]:
    """Draw one panel per metric, one line per run, into ``output``; returns the drawn names.

    Raises:
        ValueError: No run logged any of ``names``.
    """
    curves = [read_curves(run, names) for run in runs]
    drawn = [name for name in names if any(name in c for c in curves)]
    if not drawn:
        raise ValueError(f"no run logged {', '.join(names)} in TensorBoard events or metrics.csv; "
                         "name others with --metrics")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(drawn), figsize=(5 * len(drawn), 3.5), squeeze=False)
    for axis, name in zip(axes[0], drawn, strict=True):
        for run, run_curves in zip(runs, curves, strict=True):
            if name in run_curves:
                steps, values = zip(*run_curves[name], strict=True)
                axis.plot(steps, values, label=str(run))
        axis.set_title(name)
        axis.set_xlabel("step")
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    with atomic_path(output) as temporary:
        figure.savefig(temporary, format=output.suffix.lstrip(".") or "png")
    plt.close(figure)
    return drawn


def main(args: list[str] | None = None) -> list[list[str]]:
    """Print the table of runs (and draw ``--plot``); returns the table's rows (for tests)."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning compare",
        description="Compare finished runs: a table of their results.json (method, backbone, "
                    "data, steps, last (best) metrics), and their curves with --plot.")
    parser.add_argument("runs", nargs="+",
                        help="run directories, folders of runs, results.json files or patterns")
    parser.add_argument("--metrics", nargs="+", default=None,
                        help="metrics to show (default: the kNN, probe and loss ones logged)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw the metrics' curves of every run into this picture")
    options = parser.parse_args(args)
    runs, missing = find_runs(options.runs)
    if not runs:
        parser.exit(2, "error: compare: no finished run found ("
                    + "; ".join(missing) + "); name run directories, e.g. runs/simclr\n")
    try:
        records = [read_results(run / RESULTS_FILE) for run in runs]
    except ValueError as err:
        parser.exit(2, f"error: compare: {err}\n")
    logged = {name for record in records for name in record.get("metrics") or {}}
    metrics = options.metrics or [name for name in REPORTED_METRICS if name in logged]
    rows = table(runs, records, metrics)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for line in missing:
        print(f"skipped {line}")
    if options.plot is not None:
        try:
            drawn = plot(runs, options.metrics or PLOTTED_METRICS, options.plot)
        except ImportError:
            parser.exit(2, "error: compare --plot needs matplotlib: "
                           "pip install 'ssl_lightning[plots]'\n")
        except (ValueError, OSError) as err:
            parser.exit(2, f"error: compare --plot: {err}\n")
        print(f"Drew {', '.join(drawn)} of {len(runs)} run(s) into {options.plot}")
    return rows
