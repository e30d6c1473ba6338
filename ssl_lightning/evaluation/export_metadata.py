"""What an exported backbone records about its input, so that it is self-describing.

Every export writes ``<file>.json`` beside the file (atomically): the format, the
preprocessing settings (:mod:`ssl_lightning.data.preprocessing`), the backbone's spec, timm's
``pretrained_cfg`` and the Python lines that load the file. An ONNX file also carries the
preprocessing in its ``metadata_props`` (key :data:`ONNX_KEY`); a timm export's printed lines
pass the ``pretrained_cfg`` to ``timm.create_model(..., pretrained_cfg_overlay=...)``, so that
``timm.data.resolve_data_config({}, model=model)`` gives the checkpoint's preprocessing.
:func:`load_snippet` writes those lines (:func:`torchvision_resnet_recipe` for a torchvision
ResNet).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

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
    :func:`load_snippet`)."""
    if fmt == "onnx":
        return (f"import onnxruntime\nsession = onnxruntime.InferenceSession({output!r})\n"
                "features, = session.run(None, {'images': images_nchw_float32})")
    return f"import torch\nmodel = torch.jit.load({output!r}); features = model(images)"


#: The formats an export at the end of ``fit`` writes (the backbone's own).
NativeFormat = Literal["torchvision", "timm", "state_dict"]

_RESNET_DEPTHS: dict[tuple[bool, tuple[int, ...]], int] = {
    (False, (2, 2, 2, 2)): 18,
    (False, (3, 4, 6, 3)): 34,
    (True, (3, 4, 6, 3)): 50,
    (True, (3, 4, 23, 3)): 101,
    (True, (3, 8, 36, 3)): 152,
}


def torchvision_resnet_recipe(state: Mapping[str, Tensor]) -> str:
    """Python lines that build the torchvision ResNet a torchvision-format ``state`` loads into.

    Raises:
        ValueError: ``state`` is not a torchvision ResNet trunk of a known depth.
    """
    blocks = tuple(
        len({int(m.group(1)) for k in state if (m := re.match(rf"layer{i}\.(\d+)\.", k))})
        for i in range(1, 5)
    )
    bottleneck = "layer1.0.conv3.weight" in state
    depth = _RESNET_DEPTHS.get((bottleneck, blocks))
    if "conv1.weight" not in state or depth is None:
        raise ValueError(
            f"Not a torchvision ResNet trunk (blocks per stage {blocks}, bottleneck={bottleneck});"
            " export it with --format state_dict and load it into the configured backbone class."
        )
    lines = ["import torch, torchvision", "from torch import nn"]
    norm = "" if "bn1.running_mean" in state else "norm_layer=lambda c: nn.GroupNorm(32, c)"
    lines.append(f"model = torchvision.models.resnet{depth}({norm})")
    width, channels, kernel = (int(n) for n in state["conv1.weight"].shape[:3])
    if kernel == 3:
        lines.append(f"model.conv1 = nn.Conv2d({channels}, {width}, kernel_size=3, stride=1, "
                     "padding=1, bias=False)  # CIFAR stem")
        lines.append("model.maxpool = nn.Identity()")
    elif channels != 3:
        lines.append(f"model.conv1 = nn.Conv2d({channels}, {width}, kernel_size=7, stride=2, "
                     f"padding=3, bias=False)  # {channels} input channels")
    lines.append("model.fc = nn.Identity()  # outputs pooled features")
    return "\n".join(lines)


def load_snippet(fmt: NativeFormat, path: str, state: Mapping[str, Tensor],
                 spec: Mapping[str, Any] | None,
                 pretrained_cfg: Mapping[str, Any] | None = None) -> str:
    """Python lines that rebuild the model and load the exported file ``path`` into it.

    Args:
        fmt: The format ``path`` was exported in.
        path: The exported file.
        state: Its content (the torchvision recipe reads the architecture from it).
        spec: The backbone's ``{"class_path", "init_args"}`` (see
            :mod:`ssl_lightning.backbones.spec`); ``None``: the lines load into ``backbone``.
        pretrained_cfg: timm's preprocessing entries, passed as ``pretrained_cfg_overlay``
            (:func:`~ssl_lightning.evaluation.export_metadata.timm_pretrained_cfg`).
    """
    load = f"torch.load({path!r}, weights_only=True)"
    init_args = dict((spec or {}).get("init_args") or {})
    init_args.pop("pretrained_path", None)
    if fmt == "torchvision":
        return f"{torchvision_resnet_recipe(state)}\nmodel.load_state_dict({load})"
    if fmt == "timm":
        options = {**(init_args.pop("model_kwargs", None) or {}),
                   **{k: v for k, v in init_args.items() if k != "name"}}
        overlay = {"pretrained_cfg_overlay": dict(pretrained_cfg)} if pretrained_cfg else {}
        arguments = ", ".join([repr(init_args.get("name")), "num_classes=0",
                               *(f"{k}={v!r}" for k, v in {**options, **overlay}.items())])
        return (f"import timm, torch\nmodel = timm.create_model({arguments})\n"
                f"model.load_state_dict({load})")
    if spec is None:
        return f"import torch\nbackbone.load_state_dict({load})  # the backbone you trained"
    module, _, name = str(spec["class_path"]).rpartition(".")
    arguments = ", ".join(f"{k}={v!r}" for k, v in init_args.items())
    return (f"import torch\nfrom {module} import {name}\nbackbone = {name}({arguments})\n"
            f"backbone.load_state_dict({load})")
