"""``results.json``: what a finished run produced, one file per run directory.

:class:`~ssl_lightning.callbacks.RunSummary` writes it (atomically) when fit ends, beside
``config.yaml``; ``python -m ssl_lightning compare`` reads it. It holds the method, backbone and
data (class names, and the data's folder), the step and epoch reached, every scalar metric's
last and best value, and the checkpoint, export and config paths. Best values come from the
``ModelCheckpoint`` that monitors the metric when there is one (it survives a resume), else from
the validations this process saw (the maximum, or the minimum for a loss).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssl_lightning._lightning import ModelCheckpoint, pl
from ssl_lightning.io.atomic import atomic_open

#: The file's name inside a run directory.
RESULTS_FILE = "results.json"
#: Incremented when a field changes meaning.
RESULTS_VERSION = 1
#: Attributes of a data module that name where its images come from, in this order.
_DATA_LOCATIONS = ("root", "train_dir", "input_dir")


def lower_is_better(name: str) -> bool:
    """A loss is minimised; every other logged metric (accuracies) is maximised."""
    return "loss" in name.split("/")[-1]


def update_best(best: dict[str, float], metrics: Mapping[str, Any]) -> None:
    """Fold one validation's scalar metrics into ``best`` (name -> best value so far)."""
    for name, value in _scalars(metrics).items():
        previous = best.get(name)
        if previous is None or (value < previous if lower_is_better(name) else value > previous):
            best[name] = value


def results_record(trainer: pl.Trainer, module: pl.LightningModule, run_dir: str,
                   best_seen: Mapping[str, float]) -> dict[str, Any]:
    """The content of ``results.json`` for a run that just finished fitting."""
    last = _scalars(trainer.callback_metrics)
    checkpoints = [cb for cb in trainer.callbacks  # type: ignore[attr-defined]
                   if isinstance(cb, ModelCheckpoint)]
    best = {name: best_seen[name] for name in last if name in best_seen}
    for cb in checkpoints:
        if cb.monitor in last and cb.best_model_score is not None:
            best[cb.monitor] = float(cb.best_model_score)
    last_checkpoint = next((cb.last_model_path for cb in checkpoints
                            if cb.last_model_path and Path(cb.last_model_path).is_file()), None)
    backbone = getattr(module, "backbone", None)
    data = trainer.datamodule  # type: ignore[attr-defined]
    location = next((getattr(data, name) for name in _DATA_LOCATIONS
                     if getattr(data, name, None) is not None), None)
    config = Path(run_dir) / "config.yaml"
    return {
        "version": RESULTS_VERSION,
        "run_directory": str(run_dir),
        "method": type(module).__name__,
        "backbone": type(backbone).__name__ if backbone is not None else None,
        "data": {"class": type(data).__name__ if data is not None else None,
                 "location": str(location) if location is not None else None},
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "metrics": {name: {"last": value, "best": best.get(name, value)}
                    for name, value in sorted(last.items())},
        "last_checkpoint": last_checkpoint,
        "best_checkpoints": list(dict.fromkeys(cb.best_model_path for cb in checkpoints
                                               if cb.best_model_path)),
        "exported_backbones": [str(cb.exported_backbone)
                               for cb in trainer.callbacks  # type: ignore[attr-defined]
                               if getattr(cb, "exported_backbone", None)],
        "config": str(config) if config.is_file() else None,
    }


def write_results(run_dir: str, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``<run_dir>/results.json`` (temporary name, then rename)."""
    target = Path(run_dir) / RESULTS_FILE
    with atomic_open(target, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
    return target


def read_results(path: Path) -> dict[str, Any]:
    """A ``results.json`` as data (JSON only).

    Raises:
        ValueError: The file is not a JSON object (message names the file).
    """
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable results file ({err})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a results file (a JSON object was expected)")
    return record


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite one-number metrics, as floats."""
    found = {}
    for name, value in metrics.items():
        if hasattr(value, "numel") and value.numel() != 1:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            found[name] = number
    return found
