"""The CPU benchmarks side by side in one run, written as one table (Markdown and JSON).

Runs the project's own benchmark scripts as functions, each variant against its benchmark's
reference measured in the same run:

- the contrastive losses on the shared kernel (``loss_speed.py``: NT-Xent, DCL, NNCLR, MoCo v3,
  SupCon, InfoNCE) against lightly's counterpart, or the loss in plain PyTorch where lightly has
  none; our dense path; the kernel's matrix products alone (its floor), CPU seconds;
- the 2-view SimCLR views against lightly's ``SimCLRTransform`` (``views_speed.py``);
- gradient caching's peak activation memory and step time against the whole batch
  (``grad_cache_memory.py``);
- the streaming loader against the ImageFolder loader (``streaming_throughput.py``);
- indexing an image folder against torchvision's ``ImageFolder`` (``index_speed.py``);
- the ``embed`` command against a plain PyTorch loop (``embed_speed.py``);
- a Lightning training step against a hand-written loop (``step_overhead.py``).

Images are the JPEGs under ``--root``/train, or without ``--root`` synthetic 32 px JPEGs made
in a temporary folder. Writes ``benchmarks/results.md`` and ``benchmarks/results.json``
(ratios, machine, date, load average); the README's speed section is ``results.md`` between its
markers (``--readme`` copies it there) and docs/performance.md cites it.

Usage::

    python benchmarks/suite.py --readme          # full sizes, ~20 min on one busy core
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

import embed_speed  # noqa: E402
import grad_cache_memory  # noqa: E402
import index_speed  # noqa: E402
import loss_speed  # noqa: E402
import step_overhead  # noqa: E402
import streaming_throughput  # noqa: E402
import views_speed  # noqa: E402

README = HERE.parent / "README.md"
#: The pages that hold the table between the markers (``--readme`` writes both).
PAGES = (README, HERE.parent / "docs" / "performance.md")
BEGIN, END = "<!-- benchmarks/suite.py: begin -->", "<!-- benchmarks/suite.py: end -->"
FULL: dict[str, dict[str, Any]] = {
    "loss": {"batch": 4096, "repeats": 3, "rounds": 1},
    "views": {"images": 1024, "batch": 256, "rounds": 3},
    "grad_cache": {"batch_size": 256, "micro_batch_size": 32},
    "streaming": {"batch": 128, "batches": 8, "rounds": 2},
    "index": {"files": 100_000, "folders": 100, "repeats": 3},
    "embed": {"batch_size": 256, "rounds": 2},
    "step": {"backbone": "small", "batch": 128, "steps": 20, "rounds": 2},
}
#: Tiny sizes: a check that every benchmark runs (the losses' variants in this process).
TINY: dict[str, dict[str, Any]] = {
    "loss": {"batch": 64, "repeats": 1, "rounds": 1, "in_process": True},
    "views": {"images": 16, "batch": 8, "rounds": 1},
    "grad_cache": {"batch_size": 8, "micro_batch_size": 4},
    "streaming": {"batch": 4, "batches": 2, "rounds": 1},
    "index": {"files": 40, "folders": 4, "repeats": 1},
    "embed": {"batch_size": 8, "rounds": 1},
    "step": {"backbone": "small", "batch": 4, "steps": 2, "rounds": 1},
}
#: The benchmarks' names up to their first comma (the tiny-mode test checks that all run).
BENCHMARKS = (
    *(f"{loss} fwd+bwd" for loss in loss_speed.LOSSES), "2-view SimCLR views", "seeding cost",
    "SimCLR step peak activation memory", "SimCLR step time", "decode loader",
    "simclr loader", "listing an image folder", "embed", "SimCLR training step")


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


def rows_of(benchmark: str, values: dict[str, float], unit: str,
            reference: str) -> list[dict[str, Any]]:
    """One row per variant of ``benchmark``, its ratio to the ``reference`` variant's value."""
    return [{"benchmark": benchmark, "variant": variant, "value": value, "unit": unit,
             "ratio": value / values[reference], "reference": reference}
            for variant, value in values.items()]


def run(sizes: dict[str, dict[str, Any]], root: str | None) -> list[dict[str, Any]]:
    """Rows ``{benchmark, variant, value, unit, ratio, reference}`` of every benchmark."""
    rows: list[dict[str, Any]] = []
    for loss in loss_speed.LOSSES:
        results = loss_speed.measure(loss, threads=1, **sizes["loss"])
        reference = loss_speed.reference_of(loss)
        rows += rows_of(f"{loss} fwd+bwd, B x D = {sizes['loss']['batch']} x 128 fp32, one "
                        f"thread; ratio to {reference}",
                        {v: r["median_cpu_s"] for v, r in results.items()}, "CPU s", reference)
    with tempfile.TemporaryDirectory() as tmp:
        folder = root or str(synthetic_jpegs(Path(tmp), sizes["views"]["images"]))
        train = str(Path(folder) / "train")
        images = sum(1 for p in Path(train).rglob("*") if p.is_file())
        views = views_speed.measure(folder, **sizes["views"])
        rate = {v: r["images_per_cpu_s"] for v, r in views.items()}
        rows += rows_of(f"2-view SimCLR views, {sizes['views']['images']} JPEGs; ratio to "
                        "lightly", rate, "images/CPU s", "lightly SimCLRTransform")
        batch = sizes["views"]["batch"]
        for path, unseeded, seeded in (
                ("per-image", "ours SimCLRViews", "ours SimCLRViews seeded"),
                ("batched", f"ours DeviceViews on CPU (batch {batch})",
                 f"ours DeviceViews on CPU seeded (batch {batch})")):
            rows += rows_of(f"seeding cost, {path} views (same run); ratio to unseeded",
                            {unseeded: rate[unseeded], seeded: rate[seeded]}, "images/CPU s",
                            unseeded)
        rows += _grad_cache_rows(**sizes["grad_cache"])
        stream = streaming_throughput.measure(train, **sizes["streaming"])
        for pipeline in ("decode", "simclr"):
            rows += rows_of(
                f"{pipeline} loader, {images} JPEGs, batch {sizes['streaming']['batch']}, no "
                "workers; ratio to the folder", {
                    "ImageFolderDataModule": stream[pipeline]["folder_img_s"],
                    "StreamingDataModule": stream[pipeline]["streaming_img_s"]},
                "images/s", "ImageFolderDataModule")
        checkpoint = embed_speed.make_checkpoint(train, tmp)
        embed = embed_speed.measure(checkpoint, train, **sizes["embed"])
        rows += rows_of(f"embed, {images} JPEGs, ResNet-18, batch {sizes['embed']['batch_size']}; "
                        "ratio to the plain loop", embed, "images/s", "plain PyTorch loop")
    index = index_speed.measure(**sizes["index"])
    rows += rows_of(f"listing an image folder, {sizes['index']['files']} files in "
                    f"{sizes['index']['folders']} folders; ratio to torchvision", {
                        "torchvision ImageFolder": index["torchvision_s"],
                        "ImageFolderDataset": index["walk_s"],
                        "ImageFolderDataset, cache written": index["first_s"],
                        "ImageFolderDataset, cached": index["cached_s"]},
                    "s", "torchvision ImageFolder")
    step = step_overhead.measure(threads=1, **sizes["step"])
    rows += rows_of(f"SimCLR training step, {sizes['step']['backbone']} conv net, batch "
                    f"{sizes['step']['batch']}, one thread; ratio to the hand-written loop",
                    step["cpu_ms_per_step"], "CPU ms", "hand-written loop")
    return rows


def _grad_cache_rows(batch_size: int, micro_batch_size: int) -> list[dict[str, Any]]:
    """Peak activation memory and step time of a SimCLR ResNet-18 step, gradient caching's
    micro-batches against the whole batch."""
    result = grad_cache_memory.measure(batch_size, micro_batch_size, threads=1)
    names = {"whole": "whole batch", "micro": f"micro-batches of {micro_batch_size}"}
    where = f"ResNet-18, batch {batch_size}, one thread; ratio to the whole batch"
    return (rows_of(f"SimCLR step peak activation memory, {where}",
                    {names[k]: r["peak_growth_mb"] for k, r in result.items()}, "MiB",
                    "whole batch")
            + rows_of(f"SimCLR step time, {where}",
                      {names[k]: r["seconds"] for k, r in result.items()}, "s", "whole batch"))


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
             f"{info['torch']}; each variant against its benchmark's reference, measured side "
             "by side in the same run:", "",
             "| benchmark | variant | value | unit | ratio |", "|---|---|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['benchmark']} | {r['variant']} | {r['value']:.3g} | {r['unit']} | "
                     f"{r['ratio']:.2f}× |")
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str:
    """The part of a page (the README, docs/performance.md) between the suite's markers."""
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
    parser.add_argument("--readme", action="store_true",
                        help="copy the table into README.md and docs/performance.md")
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
        for page in PAGES:
            text = page.read_text()
            start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
            write(page, text[:start] + "\n" + table + text[stop:])


if __name__ == "__main__":
    main()
