"""``python -m ssl_lightning export``: a checkpoint's backbone as a file other code can load.

``python -m ssl_lightning export --checkpoint last.ckpt --format onnx --output backbone.onnx``

- ``torchvision``: keys of :class:`ssl_lightning.backbones.ResNet` without ``backbone.net.``,
  loadable by ``torchvision.models.resnet18/34/50`` after ``model.fc = nn.Identity()`` (CIFAR
  stem: also ``conv1`` and ``maxpool``; the command prints the exact lines).
- ``timm``: keys of a :class:`~ssl_lightning.backbones.TimmBackbone` without ``backbone.net.``,
  loadable by ``timm.create_model(name, num_classes=0)``; other backbones are refused.
- ``state_dict`` (alias ``backbone``): keys without ``backbone.``, loadable by the backbone
  class itself (or through its ``pretrained_path``).
- ``onnx``: the backbone rebuilt from the checkpoint, traced with a dynamic batch axis (opset
  >= 17) and checked against onnxruntime (``pip install ssl_lightning[export]``).
- ``torchscript``: ``torch.jit.trace`` of the rebuilt backbone, checked by reloading it.

An ``--output`` that is the checkpoint (or a directory) is refused before anything is read; the
file is written to a temporary name beside it and renamed once it is complete and checked, so a
failed export leaves an existing output as it was.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ssl_lightning.evaluation.checkpoint import (
    DEFAULT_PREFIX,
    SPEC_KEY,
    backbone_from_checkpoint,
    backbone_state_dict,
    load_checkpoint,
)
from ssl_lightning.evaluation.export_metadata import (
    add_onnx_metadata,
    load_snippet,
    runtime_lines,
    timm_pretrained_cfg,
    torchvision_resnet_recipe,
    write_sidecar,
)
from ssl_lightning.evaluation.preprocessing import (
    add_preprocessing_flags,
    checkpoint_preprocessing,
    preprocessing_overrides,
)
from ssl_lightning.io import atomic_path, atomic_torch_save, same_file

ExportFormat = Literal["torchvision", "timm", "state_dict", "backbone", "onnx", "torchscript"]
FORMATS: tuple[str, ...] = ("torchvision", "timm", "state_dict", "backbone", "onnx", "torchscript")
_TIMM_CLASS = "ssl_lightning.backbones.timm_models.TimmBackbone"
def check_output(checkpoint: str | os.PathLike, output: str | os.PathLike) -> None:
    """Refuse an ``output`` that is the ``checkpoint`` itself or a directory (``ValueError``)."""
    if same_file(output, checkpoint):
        raise ValueError(f"--output {os.fspath(output)!r} is the checkpoint: exporting would "
                         "overwrite it. Name another file.")
    if os.path.isdir(output):
        raise ValueError(f"--output {os.fspath(output)!r} is a directory; name a file in it.")


def _check_timm(checkpoint: str | os.PathLike, state: Mapping[str, Tensor]) -> Mapping[str, Any]:
    """The spec of a TimmBackbone checkpoint; a ``ValueError`` naming the formats that fit
    for any other backbone."""
    spec = load_checkpoint(checkpoint).get(SPEC_KEY)
    class_path = spec.get("class_path") if isinstance(spec, Mapping) else None
    if class_path == _TIMM_CLASS:
        return spec  # type: ignore[return-value]
    fitting = ["state_dict", "onnx", "torchscript"]
    try:
        torchvision_resnet_recipe(_strip_net(state, "torchvision", "a ResNet"))
        fitting.insert(0, "torchvision")
    except ValueError:
        pass
    what = f"a {class_path}" if class_path else "a backbone whose class it does not record"
    raise ValueError(f"--format timm needs a TimmBackbone checkpoint; {os.fspath(checkpoint)!r} "
                     f"holds {what}. Formats that fit: {', '.join(fitting)}.")


def native_format(checkpoint: str | os.PathLike, prefix: str = DEFAULT_PREFIX) -> str:
    """What ``--format auto`` (the default) exports for ``checkpoint``: see
    :func:`backbone_format`."""
    spec = load_checkpoint(checkpoint).get(SPEC_KEY)
    class_path = spec.get("class_path") if isinstance(spec, Mapping) else None
    return backbone_format(class_path, backbone_state_dict(checkpoint, prefix, "--prefix"))


def backbone_format(class_path: str | None, state: Mapping[str, Tensor]) -> str:
    """A backbone's own export format: ``"timm"`` for a TimmBackbone, ``"torchvision"`` for a
    ResNet trunk (keys ``net.*``) that torchvision's ResNet loads, else ``"state_dict"`` (the
    backbone class's own keys). ``state`` is the backbone's state dict."""
    if class_path == _TIMM_CLASS:
        return "timm"
    try:
        torchvision_resnet_recipe(_strip_net(state, "torchvision", "a ResNet"))
    except ValueError:
        return "state_dict"
    return "torchvision"


def _strip_net(state: Mapping[str, Tensor], fmt: str, what: str) -> dict[str, Tensor]:
    if not all(k.startswith("net.") for k in state):
        raise ValueError(
            f"--format {fmt} needs {what} (keys 'net.*'); this backbone has "
            f"{sorted(state)[:3]}... Use --format state_dict."
        )
    return {k[len("net."):]: v for k, v in state.items()}


def export_state_dict(
    checkpoint: str | os.PathLike, output: str | os.PathLike, fmt: str = "torchvision",
    prefix: str = DEFAULT_PREFIX,
) -> dict[str, Tensor]:
    """Write the backbone weights of ``checkpoint`` to ``output`` with ``torch.save``.

    Args:
        checkpoint: A pre-training checkpoint of any ssl_lightning method.
        output: Path of the state-dict file.
        fmt: ``"torchvision"`` (ResNet backbones), ``"timm"`` (TimmBackbone) or
            ``"state_dict"`` / ``"backbone"``.
        prefix: Prefix of the backbone in the checkpoint's state dict.
    """
    check_output(checkpoint, output)
    state = backbone_state_dict(checkpoint, prefix, "--prefix")
    if fmt == "torchvision":
        state = _strip_net(state, fmt, "an ssl_lightning ResNet backbone")
        torchvision_resnet_recipe(state)
    elif fmt == "timm":
        _check_timm(checkpoint, state)
        state = _strip_net(state, fmt, "a TimmBackbone")
    elif fmt not in ("state_dict", "backbone"):
        raise ValueError(f"Unknown state-dict format {fmt!r}; choose one of {FORMATS}.")
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    atomic_torch_save(state, output)
    return state


def _example_input(backbone: nn.Module, image_size: int | None, channels: int = 3) -> Tensor:
    size = image_size or int(getattr(backbone, "backbone_spec", {}).get(
        "init_args", {}).get("image_size", 32) or 32)
    return torch.randn(2, channels, size, size, generator=torch.Generator().manual_seed(0))


def export_onnx(
    checkpoint: str | os.PathLike, output: str | os.PathLike, image_size: int | None = None,
    prefix: str = DEFAULT_PREFIX, opset: int = 18, settings: Mapping[str, Any] | None = None,
) -> float:
    """Export the rebuilt backbone to ONNX (dynamic batch) and return the largest absolute
    difference to PyTorch in onnxruntime on a batch of a different size than the trace's.
    ``settings``: the preprocessing, stored in the file's ``metadata_props``
    (:mod:`ssl_lightning.evaluation.export_metadata`) and giving the example's channels."""
    try:
        import onnxruntime
    except ImportError as err:
        raise ImportError(
            "ONNX export needs onnx and onnxruntime: `pip install \"ssl_lightning[export]\"`."
        ) from err
    if opset < 17:
        raise ValueError(f"opset must be >= 17, got {opset}.")
    check_output(checkpoint, output)
    backbone = backbone_from_checkpoint(checkpoint, prefix=prefix, flag="--prefix").eval()
    example = _example_input(backbone, image_size, int((settings or {}).get("channels", 3)))
    with atomic_path(output) as tmp:
        try:
            torch.onnx.export(
                backbone, (example,), os.fspath(tmp), input_names=["images"],
                output_names=["features"], opset_version=opset, dynamo=False,
                dynamic_axes={"images": {0: "batch"}, "features": {0: "batch"}},
            )
        except Exception as err:
            raise ValueError(
                f"The backbone {type(backbone).__name__} cannot be exported to ONNX "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
                "Export --format state_dict or torchscript instead."
            ) from err
        if settings is not None:
            add_onnx_metadata(tmp, settings)
        check = torch.cat([example, example[:1]])  # another batch size than the trace's
        session = onnxruntime.InferenceSession(os.fspath(tmp),
                                               providers=["CPUExecutionProvider"])
        (onnx_out,) = session.run(None, {"images": check.numpy()})
    with torch.no_grad():
        expected = backbone(check).numpy()
    return float(abs(onnx_out - expected).max())


def export_torchscript(
    checkpoint: str | os.PathLike, output: str | os.PathLike, image_size: int | None = None,
    prefix: str = DEFAULT_PREFIX, channels: int = 3,
) -> float:
    """``torch.jit.trace`` the rebuilt backbone (on ``channels``-channel examples), reload it,
    and return the largest absolute difference to the eager module on a batch of a different
    size than the trace's."""
    check_output(checkpoint, output)
    backbone = backbone_from_checkpoint(checkpoint, prefix=prefix, flag="--prefix").eval()
    example = _example_input(backbone, image_size, channels)
    try:
        with torch.no_grad():
            traced = torch.jit.trace(backbone, example)
    except Exception as err:
        raise ValueError(
            f"The backbone {type(backbone).__name__} cannot be traced by TorchScript "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Export "
            "--format state_dict or onnx instead."
        ) from err
    with atomic_path(output) as tmp:
        torch.jit.save(traced, os.fspath(tmp))
        reloaded = torch.jit.load(os.fspath(tmp))
    check = torch.cat([example, example[:1]])
    with torch.no_grad():
        return float((reloaded(check) - backbone(check)).abs().max())


def main(args: list[str] | None = None) -> None:
    """Command line of ``python -m ssl_lightning export``: export and print how to load."""
    parser = argparse.ArgumentParser(
        prog="python -m ssl_lightning export",
        description="Export a checkpoint's backbone (state dict, ONNX or TorchScript).")
    parser.add_argument("--checkpoint", required=True, help="pre-training .ckpt file")
    parser.add_argument("--output", required=True, help="file to write")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="auto (default): the backbone's own kind - timm for a timm "
                             "model, torchvision for a ResNet, else state_dict")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="backbone prefix in the ckpt")
    parser.add_argument("--image-size", type=int, default=None,
                        help="side of the example input for onnx/torchscript (default: the "
                             "checkpoint's crop size)")
    add_preprocessing_flags(parser)
    ns = parser.parse_args(args)
    out = ns.output
    try:
        check_output(ns.checkpoint, out)
        settings = checkpoint_preprocessing(ns.checkpoint, "export",
                                            **preprocessing_overrides(ns))
        size = ns.image_size or int(settings["crop_size"])
        if ns.format == "auto":
            ns.format = native_format(ns.checkpoint, ns.prefix)
        spec = load_checkpoint(ns.checkpoint).get(SPEC_KEY)
        if ns.format == "onnx":
            diff = export_onnx(ns.checkpoint, out, size, ns.prefix, settings=settings)
            done = f"Wrote {out} (dynamic batch axis; onnxruntime vs PyTorch max |diff| {diff:.2e})"
            lines = runtime_lines("onnx", out)
        elif ns.format == "torchscript":
            diff = export_torchscript(ns.checkpoint, out, size, ns.prefix,
                                      int(settings["channels"]))
            done = f"Wrote {out} (reloaded: max |diff| {diff:.2e})"
            lines = runtime_lines("torchscript", out)
        else:
            state = export_state_dict(ns.checkpoint, out, ns.format, ns.prefix)
            fmt = "state_dict" if ns.format == "backbone" else ns.format
            done = f"Wrote {len(state)} tensors to {out}"
            lines = load_snippet(fmt, out, state,  # type: ignore[arg-type]
                                 spec if isinstance(spec, Mapping) else None,
                                 timm_pretrained_cfg(settings))
        sidecar = write_sidecar(out, ns.format, settings,
                                spec if isinstance(spec, Mapping) else None, lines)
        print(f"{done}; its preprocessing is in {sidecar}. Load it with:\n{lines}")
    except (ValueError, OSError, ImportError) as err:
        parser.exit(2, f"export: error: {err}\n")


if __name__ == "__main__":
    main()
