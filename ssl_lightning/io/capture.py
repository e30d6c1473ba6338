"""The capture folder of a diverged step: what :class:`~ssl_lightning.callbacks.
DivergenceCapture` writes and ``python -m ssl_lightning replay`` reads.

``<run directory>/divergence/step-<global step>/`` holds

- ``manifest.json``: the step's identity (epoch, batch, global step, world size, per-rank batch
  size), why it was captured, the trainer settings the schedules depend on, the data seed and
  dataset size, the environment (Python, torch, Lightning, CUDA, precision) and the names of
  the files below;
- ``state.ckpt``: a Lightning checkpoint of the state before the step (weights, optimiser,
  schedulers, EMA teachers, queues, centres, callbacks, loops), loadable with
  ``weights_only=True``;
- ``config.yaml``: the run's resolved config (runs of ``python -m ssl_lightning fit``);
- ``rank-<r>.json`` / ``rank-<r>.pt``: each rank's samples (seeds, dataset indices) and loss;
- ``gradients.pt``: the step's gradients, when the capture was made after the backward pass.

Every file is data (JSON, YAML text, tensors); the folder is built under a temporary name and
renamed into place when complete, so a folder of that name is always a whole capture.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
from pathlib import Path
from typing import Any

import torch

from ssl_lightning.io.atomic import atomic_open, atomic_torch_save

#: Folder of the captures inside the run directory.
CAPTURES_DIR = "divergence"
MANIFEST = "manifest.json"
STATE = "state.ckpt"
CONFIG = "config.yaml"
GRADIENTS = "gradients.pt"
FORMAT = 1


def rank_files(rank: int) -> tuple[str, str]:
    """The (JSON, tensors) file names of ``rank``'s part."""
    return f"rank-{rank}.json", f"rank-{rank}.pt"


def new_capture_dir(run_dir: str | os.PathLike, global_step: int) -> tuple[Path, Path]:
    """(temporary folder to write into, final name) of a capture of ``global_step``: the final
    name is ``step-<n>`` (``step-<n>-2``, ... when a folder of that name exists, which this run
    did not write)."""
    root = Path(run_dir) / CAPTURES_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{global_step}"
    suffix = 2
    while final.exists():
        final = root / f"step-{global_step}-{suffix}"
        suffix += 1
    temporary = root / f".{final.name}.{secrets.token_hex(6)}.tmp"
    temporary.mkdir()
    return temporary, final


def write_json(path: str | os.PathLike, value: Any) -> None:
    """``value`` as indented, strict JSON (no NaN), written atomically."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=1, sort_keys=True, allow_nan=False)
        handle.write("\n")


def write_tensors(path: str | os.PathLike, value: dict[str, Any]) -> None:
    """A dict of tensors / plain values, written atomically (loads with ``weights_only``)."""
    atomic_torch_save(value, path)


def finish(temporary: Path, final: Path) -> None:
    """Rename the complete ``temporary`` folder to ``final``."""
    os.replace(temporary, final)


def environment(precision: str) -> dict[str, Any]:
    """Versions and devices the step ran with."""
    from ssl_lightning._lightning import pl

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "lightning": pl.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "precision": precision, "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


class CaptureError(ValueError):
    """A folder that is not a readable capture."""


def read_manifest(capture: str | os.PathLike) -> dict[str, Any]:
    """The capture's manifest.

    Raises:
        CaptureError: ``capture`` is not a folder holding a capture's ``manifest.json``.
    """
    folder = Path(capture)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise CaptureError(f"{os.fspath(capture)!r} is not a folder; name a capture folder, "
                           f"e.g. <run directory>/{CAPTURES_DIR}/step-<n>.")
    if not path.is_file():
        raise CaptureError(f"{os.fspath(capture)!r} holds no {MANIFEST}: it is not a capture "
                           f"folder (they are <run directory>/{CAPTURES_DIR}/step-<n>).")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CaptureError(f"{path} cannot be read ({err}).") from err
    if manifest.get("format") != FORMAT:
        raise CaptureError(f"{path} has capture format {manifest.get('format')!r}; this "
                           f"version of ssl_lightning reads format {FORMAT}.")
    return manifest


def read_tensors(path: str | os.PathLike) -> dict[str, Any]:
    """A tensor file of the capture, loaded as data (``weights_only=True``) on the CPU.

    Raises:
        CaptureError: the file is missing or not a weights-only tensor file.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise CaptureError(f"{os.fspath(path)} cannot be loaded as data ({err}).") from err


def read_ranks(capture: str | os.PathLike, world_size: int) -> list[dict[str, Any]]:
    """Every rank's part: the JSON record with its ``loss`` tensor added."""
    parts = []
    for rank in range(world_size):
        text, tensors = (Path(capture) / name for name in rank_files(rank))
        try:
            record = json.loads(text.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CaptureError(f"{text} cannot be read ({err}): the capture is incomplete.") \
                from err
        record.update(read_tensors(tensors))
        parts.append(record)
    return parts
