"""The CPU benchmarks side by side in one run, written as one table (Markdown and JSON).

Runs the project's own benchmark scripts as functions: the contrastive losses on the shared
chunked kernel against lightly's (``loss_speed.py``: NT-Xent, DCL; and the kernel's matrix
products alone, its floor) and the 2-view SimCLR views against lightly's ``SimCLRTransform``
(``views_speed.py``, on the JPEGs under ``--root``/train; without ``--root`` on synthetic
32 px JPEGs made in a temporary folder). Writes ``benchmarks/results.md`` and
``benchmarks/results.json`` (ratios, machine, date, load average); the README's speed section
is ``results.md`` between its markers (``--readme`` copies it there).

Usage::

    python benchmarks/suite.py --readme          # full sizes, ~10 min on one busy core
    python benchmarks/suite.py --tiny --output /tmp/suite   # seconds: checks that all run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import loss_speed  # noqa: E402
import views_speed  # noqa: E402

README = HERE.parent / "README.md"
BEGIN, END = "<!-- benchmarks/suite.py: begin -->", "<!-- benchmarks/suite.py: end -->"
FULL = {"loss": {"batch": 4096, "repeats": 3, "rounds": 1},
        "views": {"images": 1024, "batch": 256, "rounds": 2}}
TINY = {"loss": {"batch": 64, "repeats": 1, "rounds": 1},
        "views": {"images": 16, "batch": 8, "rounds": 1}}


def synthetic_jpegs(root: Path, images: int) -> Path:
    """``images`` smooth random 32 px JPEGs in 10 class folders under ``root``/train."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for index in range(images):
        folder = root / "train" / f"class_{index % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).resize((32, 32), Image.Resampling.BILINEAR).save(
            folder / f"{index}.jpg", quality=90)
    return root


def run(sizes: dict[str, dict[str, int]], root: str | None) -> list[dict[str, Any]]:
    """Rows ``{benchmark, variant, value, unit, ratio, reference}`` of every benchmark."""
    rows: list[dict[str, Any]] = []
    for loss in loss_speed.LOSSES:
        results = loss_speed.measure(loss, threads=1, **sizes["loss"])
        reference = results["lightly"]["median_cpu_s"]
        name = f"{loss} fwd+bwd, 2 x {sizes['loss']['batch']} x 128 fp32, CPU s"
        for variant, r in results.items():
            rows.append({"benchmark": name, "variant": variant, "value": r["median_cpu_s"],
                         "unit": "CPU s", "ratio": r["median_cpu_s"] / reference,
                         "reference": "lightly"})
    with tempfile.TemporaryDirectory() as tmp:
        folder = root or str(synthetic_jpegs(Path(tmp), sizes["views"]["images"]))
        views = views_speed.measure(folder, **sizes["views"])
    reference = views["lightly SimCLRTransform"]["images_per_cpu_s"]
    name = f"2-view SimCLR views, {sizes['views']['images']} JPEGs, images per CPU s"
    for variant, r in views.items():
        rows.append({"benchmark": name, "variant": variant, "value": r["images_per_cpu_s"],
                     "unit": "images/CPU s", "ratio": r["images_per_cpu_s"] / reference,
                     "reference": "lightly"})
    return rows


def machine() -> dict[str, Any]:
    """Where and when the table was measured."""
    import torch

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_average": [round(x, 1) for x in os.getloadavg()], "torch": torch.__version__,
            "python": platform.python_version()}


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    """The table with its command, machine, date and load."""
    lines = [f"`{command}`, {info['date']}, {info['cores']} cores, load average "
             f"{' / '.join(str(x) for x in info['load_average'])} (1 / 5 / 15 min), torch "
             f"{info['torch']}; one thread, CPU time:", "",
             "| benchmark | variant | value | unit | vs lightly |", "|---|---|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['benchmark']} | {r['variant']} | {r['value']:.3g} | {r['unit']} | "
                     f"{r['ratio']:.2f}× |")
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str:
    """The part of the README between the suite's markers."""
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:stop].strip("\n") + "\n"


def write(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary name and a rename."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a check, not figures)")
    parser.add_argument("--root", help="ImageFolder root with train/ (default: synthetic JPEGs)")
    parser.add_argument("--output", default=str(HERE), help="folder for results.md/json")
    parser.add_argument("--readme", action="store_true", help="copy the table into README.md")
    args = parser.parse_args()
    command = "python benchmarks/suite.py" + (" --tiny" if args.tiny else "")
    rows = run(TINY if args.tiny else FULL, args.root)
    info = machine()
    table = markdown(rows, info, command)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    write(output / "results.md", table)
    write(output / "results.json", json.dumps({"machine": info, "command": command,
                                                     "rows": rows}, indent=2) + "\n")
    print(table)
    if args.readme:
        text = README.read_text()
        start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
        write(README, text[:start] + "\n" + table + text[stop:])


if __name__ == "__main__":
    main()
