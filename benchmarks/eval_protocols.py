"""Run a chosen set of evaluation protocols on one checkpoint and a labelled image folder, and
print one table of their numbers (the rows the papers report).

    python benchmarks/eval_protocols.py --checkpoint runs/dinov2/version_0/checkpoints/last.ckpt \
        --train-dir /data/pets/train --val-dir /data/pets/val --num-classes 37 \
        --protocols knn fewshot linear_grid attentive --preset imagenet

Each protocol is its shipped config run through the real CLI (``configs/knn.yaml`` with DINOv2's
k = 10, 20, 100, 200 at each ``--temperatures`` value, DINOv2's 0.07 by default;
``configs/fewshot.yaml``; ``configs/linear_grid.yaml``;
``configs/attentive.yaml``) on ``ImageFolderDataModule`` (``<dir>/<class>/*``), each in its own
temporary run directory (removed afterwards; nothing is written to the working directory).
``--cnn`` runs the linear grid on the pooled feature (a CNN has no [CLS] or blocks) and skips
the attentive probe. ``--epochs`` shortens the trained probes; ``--set`` passes more CLI
arguments to every protocol (e.g. ``--set=--trainer.devices=2``). ``--random-init`` runs the
same protocols on the sanity baseline: the backbone the checkpoint records (``backbone_spec``:
same class and shape), randomly initialised under the configs' seed, instead of the checkpoint's
weights.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ssl_lightning.backbones.checkpoint import SPEC_KEY, load_checkpoint
from ssl_lightning.cli import main
from ssl_lightning.evaluation.checkpoint import RANDOM_INIT

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: protocol -> (config, subcommand, trains a classifier: takes num_classes and epochs)
PROTOCOLS: dict[str, tuple[str, str, bool]] = {
    "knn": ("knn.yaml", "validate", False),
    "fewshot": ("fewshot.yaml", "validate", False),
    "linear_grid": ("linear_grid.yaml", "fit", True),
    "attentive": ("attentive.yaml", "fit", True),
}


def protocol_args(name: str, args: argparse.Namespace, run_dir: str) -> list[str]:
    """The CLI arguments of protocol ``name``, run in ``run_dir`` (its own folder: two runs of
    this script, or of two protocols, never share a run directory and its lock)."""
    config, subcommand, trains = PROTOCOLS[name]
    cli = [subcommand, "--config", str(CONFIGS / config), *checkpoint_args(args),
           "--trainer.default_root_dir", run_dir,
           "--data", "ImageFolderDataModule", "--data.train_dir", args.train_dir,
           "--data.val_dir", args.val_dir, "--data.preset", args.preset,
           "--data.num_workers", str(args.num_workers), "--data.batch_size", str(args.batch_size),
           "--trainer.logger", "false"]
    if name == "knn":
        cli += ["--model.ks", "[10, 20, 100, 200]", "--model.num_classes", str(args.num_classes),
                "--model.temperatures", json.dumps(args.temperatures)]
    if trains:
        cli += ["--model.num_classes", str(args.num_classes),
                "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]"]
        if args.epochs is not None:
            cli += ["--trainer.max_epochs", str(args.epochs)]
    if name == "fewshot" and args.shots:
        cli += ["--model.shots", str(args.shots)]
    if name == "linear_grid" and args.cnn:
        cli += ["--model.poolings", "[pooled]", "--model.last_blocks", "[1]"]
    return cli + list(args.set)


def checkpoint_args(args: argparse.Namespace) -> list[str]:
    """``--model.checkpoint`` (and, for ``--random-init``, the recorded backbone) of every
    protocol."""
    if not args.random_init:
        return ["--model.checkpoint", args.checkpoint]
    spec = load_checkpoint(args.checkpoint).get(SPEC_KEY)
    if not isinstance(spec, dict):
        raise SystemExit(f"error: {args.checkpoint} records no backbone ({SPEC_KEY}), so "
                         "--random-init cannot build one of the same shape; run the protocols "
                         "with --set=--model.backbone=... --set=--model.checkpoint=random.")
    return ["--model.checkpoint", RANDOM_INIT, "--model.backbone", json.dumps(spec)]


def rows(name: str, metrics: dict[str, float], model: Any) -> list[tuple[str, str, float]]:
    """Table rows ``(protocol, metric, top-1 %)`` of one protocol's final metrics."""
    if name == "knn":
        scored = [(tuple(float(v) for v in found.groups()), key) for key in metrics
                  if (found := re.fullmatch(r"val/knn_k(\d+)_t([\d.e+-]+)_top1", key))]
        return [(name, key.removeprefix("val/knn_").removesuffix("_top1"), metrics[key])
                for _, key in sorted(scored, key=lambda pair: (pair[0][1], pair[0][0]))]
    if name == "fewshot":
        return [(name, f"{key.removeprefix('val/fewshot_').removesuffix('_top1')} "
                 f"(± {metrics[key + '_std']:.2f})", value)
                for key, value in metrics.items() if key.endswith("_top1")]
    best = model.specs[int(model.best_head)]
    lrs = sorted({spec.lr for spec in model.specs})
    edge = (" (lr at the grid's edge: " + ("under-trained? more epochs" if best.lr == lrs[-1]
                                            else "extend the grid down") + ")"
            if len(lrs) > 1 and best.lr in (lrs[0], lrs[-1]) else "")
    return [(name, f"best head {best.name} ({len(model.specs)} heads){edge}",
             metrics["val/top1"])]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--train-dir", required=True)
    parser.add_argument("--val-dir", required=True)
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--protocols", nargs="+", choices=list(PROTOCOLS), default=list(PROTOCOLS))
    parser.add_argument("--preset", default="imagenet", help="the data module's transform preset")
    parser.add_argument("--epochs", type=int, default=None, help="of the trained probes")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--shots", type=int, nargs="+", default=None,
                        help="few-shot images per class (the config's 1 2 5 10 by default)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.07],
                        help="kNN vote temperatures (each with k = 10, 20, 100, 200)")
    parser.add_argument("--cnn", action="store_true", help="a CNN backbone (no tokens)")
    parser.add_argument("--set", action="append", default=[], help="more CLI arguments")
    parser.add_argument("--random-init", action="store_true",
                        help="the baseline: the checkpoint's backbone class and shape, randomly "
                             "initialised (its weights are not loaded)")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    args = parse(argv)
    sys.argv = sys.argv[:1]  # the CLI reads only the arguments it is given
    table: list[tuple[str, str, float]] = []
    seconds: dict[str, float] = {}
    for name in args.protocols:
        if name == "attentive" and args.cnn:
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"eval_protocols_{name}_") as run_dir:
            cli = main(protocol_args(name, args, run_dir))
        seconds[name] = time.perf_counter() - start
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        table += rows(name, metrics, cli.model)
    width = max(len(metric) for _, metric, _ in table)
    weights = "random init (same backbone shape)" if args.random_init else "checkpoint weights"
    print(f"\n{args.checkpoint}: {weights}")
    print(f"{'protocol':<12} {'metric':<{width}}  top-1 (%)")
    for name, metric, value in table:
        print(f"{name:<12} {metric:<{width}}  {value:6.2f}")
    print("wall time: " + ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items()))


if __name__ == "__main__":
    run()
