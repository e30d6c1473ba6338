"""Checks of a ``--ckpt_path`` against the run that resumes from it, before anything trains.

- the file: missing, empty, truncated or not a Lightning checkpoint -> the file named and what
  to do, instead of a ``PytorchStreamReader`` / ``EOFError`` traceback;
- the strategy: a sharded checkpoint directory resumes only under ``ShardedStrategy``;
- the method: resuming needs the class the checkpoint was trained with;
- the hyperparameters: every one whose new value differs is listed in one warning; the new
  run's values are used (the checkpoint supplies the weights, the optimiser state and the step);
  the optimiser itself cannot change; the original run's files are kept (see
  :func:`keep_last_checkpoints`);
- the architecture: the checkpoint's weights must fit the configured model key for key and
  shape for shape.
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ssl_lightning._lightning import rank_zero_warn
from ssl_lightning.cli.errors import CLIError
from ssl_lightning.compat.renamed import rename_hyperparameters, rename_state_keys
from ssl_lightning.distributed.sharding import ShardedStrategy, is_sharded_checkpoint
from ssl_lightning.evaluation.checkpoint import load_checkpoint
from ssl_lightning.io import atomic_path

#: Hyperparameters a resume cannot change (the optimiser state is specific to the optimiser).
FIXED_ON_RESUME = ("optimizer",)
_PREVIOUS = ("Resume from the previous checkpoint (e.g. a best-*.ckpt or an earlier last.ckpt "
             "beside it) or start the run again without --ckpt_path.")


def read_checkpoint(path: str) -> Mapping[str, Any]:
    """The checkpoint at ``path``, or a :class:`CLIError` naming the file and what to do."""
    try:
        return load_checkpoint(path, "--ckpt_path", _PREVIOUS)
    except FileNotFoundError as err:
        raise CLIError(f"--ckpt_path: {err} Check the path (it is relative to the working "
                       f"directory {os.getcwd()!r}).") from err
    except ValueError as err:
        raise CLIError(str(err)) from err


def check_strategy(strategy: object, path: str) -> None:
    """Refuse a sharded checkpoint directory under another strategy than ``ShardedStrategy``
    (Lightning's loaders would fail on the directory with an ``IsADirectoryError``)."""
    if is_sharded_checkpoint(path) and not isinstance(strategy, ShardedStrategy):
        raise CLIError(
            f"--ckpt_path {path!r} is a sharded checkpoint (a distributed-checkpoint directory "
            f"written by ShardedStrategy), and this run's strategy is "
            f"{type(strategy).__name__}: compose configs/shared/fsdp.yaml after the method's "
            "config (--config <method>.yaml --config configs/shared/fsdp.yaml) to resume it. "
            "(`python -m ssl_lightning consolidate` makes one file of it for evaluation and "
            "export; that file has no optimiser state.)"
        )


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def check_method_and_hyperparameters(checkpoint: Mapping[str, Any], path: str,
                                     model_config: Mapping[str, Any], kept: str = "") -> bool:
    """Refuse another method (or optimiser); warn once about every hyperparameter that differs.

    Args:
        checkpoint: The loaded checkpoint.
        path: Its file, for the messages.
        model_config: The new run's ``model`` config as dumped by the CLI
            (``{"class_path": ..., "init_args": {...}}``).
        kept: What happens to the original run's files then, appended to the warning.

    Returns:
        Whether a hyperparameter differs.
    """
    saved = dict(checkpoint.get("hyper_parameters") or {})
    saved.pop("_instantiator", None)
    saved_class = saved.pop("_class_path", None)
    new_class = model_config.get("class_path")
    if saved_class is not None and new_class is not None and saved_class != new_class:
        raise CLIError(
            f"--ckpt_path {path!r} is a {saved_class} checkpoint, the config's model is "
            f"{new_class}: resuming needs the same method. Use the config the checkpoint was "
            f"trained with (--model {saved_class}), or drop --ckpt_path to train {new_class} "
            "from scratch."
        )
    configured = dict(model_config.get("init_args") or {})
    method = _method_class(saved_class or new_class)
    if method is not None:  # a checkpoint (or config) written under renamed argument names
        rename_hyperparameters(saved, method)
        rename_hyperparameters(configured, method)
    old, new = _flatten(saved), _flatten(configured)
    differ = [(k, old[k], new.get(k, "(absent)")) for k in sorted(old) if old[k] != new.get(k)]
    fixed = [d for d in differ if d[0] in FIXED_ON_RESUME]
    if fixed:
        name, before, after = fixed[0]
        raise CLIError(
            f"--ckpt_path {path!r} was trained with {name}={before!r}, this run sets "
            f"{name}={after!r}: the optimiser state cannot be carried over to another "
            f"optimiser. Resume with --model.{name} {before}, or start a new run."
        )
    if differ:
        listing = "; ".join(f"{k}: {b!r} (checkpoint) -> {a!r} (this run)" for k, b, a in differ)
        rank_zero_warn(
            f"Resuming from {path!r} with {len(differ)} hyperparameter(s) that differ from the "
            f"checkpoint's: {listing}. This run's values are used; the checkpoint supplies the "
            "weights, the optimiser state and the step." + (f" {kept}" if kept else "")
        )
    return bool(differ)


def _method_class(class_path: object) -> type | None:
    """The class a ``class_path`` names (short names from ``ssl_lightning``), or None."""
    module, _, name = str(class_path or "").rpartition(".")
    try:
        found = getattr(importlib.import_module(module or "ssl_lightning"), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def check_architecture(model: nn.Module, checkpoint: Mapping[str, Any], path: str) -> None:
    """Refuse a checkpoint whose weights do not fit ``model`` (missing, extra or reshaped keys)."""
    saved = dict(checkpoint.get("state_dict") or {})
    rename_state_keys(saved, model)  # old teacher names load (the model's load hook renames)
    unsaved = tuple(getattr(model, "unsaved_state_prefixes", ()))  # rebuilt on load instead
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(unsaved)}
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    data_sized = tuple(getattr(model, "data_sized_state", ()))  # sized by the data, not config
    reshaped = [f"{k} {tuple(saved[k].shape)} in the checkpoint, {tuple(v.shape)} configured"
                for k, v in expected.items() if k in saved and tuple(saved[k].shape) != v.shape
                and k not in data_sized]
    if not (missing or unexpected or reshaped):
        return
    parts = [f"{len(items)} {what} ({', '.join(items[:3])}{', ...' if len(items) > 3 else ''})"
             for what, items in (("missing keys", missing), ("unexpected keys", unexpected),
                                 ("shape mismatches", reshaped)) if items]
    raise CLIError(
        f"--ckpt_path {path!r} does not fit the configured {type(model).__name__}: "
        f"{'; '.join(parts)}. It was written by another architecture: resume with the model "
        "config it was trained with (see its config.yaml beside the logs), or pass a "
        "checkpoint of this model."
    )


#: Appended to the changed-hyperparameter warning: what a resume with other settings keeps.
KEPT_ON_CHANGE = (
    "The original run is kept: this run writes into a new version folder of the logger (not the "
    "checkpoint's), and a last.ckpt it would replace is first copied to "
    "last-before-resume[-N].ckpt beside it; --resume_in_place true continues in the checkpoint's "
    "folder and replaces its last.ckpt.")


def keep_last_checkpoints(folders: Iterable[str]) -> list[tuple[str, str]]:
    """Copy every existing ``<folder>/last.ckpt`` to the first free
    ``<folder>/last-before-resume[-N].ckpt`` (written to a temporary name and renamed), so a
    resumed run with changed settings does not replace the original run's last state.

    Returns:
        The ``(original, copy)`` pairs.
    """
    kept = []
    for folder in dict.fromkeys(folders):
        last = Path(folder) / "last.ckpt"
        if not last.is_file():
            continue
        copy, n = Path(folder) / "last-before-resume.ckpt", 1
        while copy.exists():
            copy, n = Path(folder) / f"last-before-resume-{n}.ckpt", n + 1
        with atomic_path(copy) as tmp:
            shutil.copyfile(last, tmp)
        kept.append((str(last), str(copy)))
    return kept
