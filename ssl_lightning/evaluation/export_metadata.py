"""What an exported backbone records about its input, so that it is self-describing.

Every export writes ``<file>.json`` beside the file (atomically): the format, the
preprocessing settings (:mod:`ssl_lightning.data.preprocessing`), the backbone's spec, timm's
``pretrained_cfg`` and the Python lines that load the file. An ONNX file also carries the
preprocessing in its ``metadata_props`` (key :data:`ONNX_KEY`); a timm export's printed lines
pass the ``pretrained_cfg`` to ``timm.create_model(..., pretrained_cfg_overlay=...)``, so that
``timm.data.resolve_data_config({}, model=model)`` gives the checkpoint's preprocessing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssl_lightning.io import atomic_open

#: Key of the preprocessing JSON in an ONNX file's ``metadata_props``.
ONNX_KEY = "ssl_lightning.preprocessing"


def timm_pretrained_cfg(settings: Mapping[str, Any]) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` entries for ``settings``: ``input_size`` (C, H, W), ``mean``,
    ``std`` (of images scaled to [0, 1], as this project's RGB normalisation), the resize
    ``interpolation``, ``crop_pct`` (crop / resize) and ``crop_mode``."""
    crop, resize = int(settings["crop_size"]), int(settings["resize_size"])
    return {"input_size": (int(settings["channels"]), crop, crop),
            "mean": tuple(float(v) for v in settings["mean"]),
            "std": tuple(float(v) for v in settings["std"]),
            "interpolation": str(settings["interpolation"]), "crop_pct": crop / resize,
            "crop_mode": "center"}


def sidecar_path(output: str | os.PathLike) -> Path:
    """``<output>.json``: the export's description."""
    return Path(f"{os.fspath(output)}.json")


def write_sidecar(output: str | os.PathLike, fmt: str, settings: Mapping[str, Any],
                  spec: Mapping[str, Any] | None, load: str) -> Path:
    """Write ``<output>.json`` atomically (see the module docstring); returns its path."""
    description = {"file": os.path.basename(os.fspath(output)), "format": fmt,
                   "preprocessing": dict(settings),
                   "pretrained_cfg": timm_pretrained_cfg(settings),
                   "backbone_spec": dict(spec) if spec is not None else None,
                   "load": load}
    path = sidecar_path(output)
    with atomic_open(path, "w", encoding="utf-8") as handle:
        json.dump(description, handle, indent=2, default=repr)
        handle.write("\n")
    return path


def add_onnx_metadata(path: str | os.PathLike, settings: Mapping[str, Any]) -> None:
    """Store ``settings`` as JSON under :data:`ONNX_KEY` in the ONNX file's
    ``metadata_props`` (rewriting the file in place: call on a temporary file)."""
    import onnx

    model = onnx.load(os.fspath(path))
    entry = model.metadata_props.add()
    entry.key, entry.value = ONNX_KEY, json.dumps(dict(settings))
    onnx.save(model, os.fspath(path))


def runtime_lines(fmt: str, output: str) -> str:
    """The lines that load an ONNX or TorchScript export and compute the features of
    ``images_nchw_float32`` (a NumPy array) or ``images`` (a tensor) (the state-dict formats:
    :func:`~ssl_lightning.evaluation.export_callback.load_snippet`)."""
    if fmt == "onnx":
        return (f"import onnxruntime\nsession = onnxruntime.InferenceSession({output!r})\n"
                "features, = session.run(None, {'images': images_nchw_float32})")
    return f"import torch\nmodel = torch.jit.load({output!r}); features = model(images)"
