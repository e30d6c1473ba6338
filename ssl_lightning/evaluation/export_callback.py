"""Export the backbone when ``fit`` finishes: a file in the run directory in the backbone's own
format, and the Python lines that load it printed on the console.

The export goes through :func:`ssl_lightning.evaluation.export.export_state_dict`, the code of
the ``export`` command, on the trained module's weights. That module is imported where it is
used, so that importing :mod:`ssl_lightning.evaluation` leaves
``python -m ssl_lightning.evaluation.export`` to run it as ``__main__``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ssl_lightning._lightning import pl
from ssl_lightning.backbones import backbone_spec
from ssl_lightning.callbacks.artifacts import log_run_file
from ssl_lightning.data.preprocessing import preprocessing_record
from ssl_lightning.distributed.sharding import full_state_dict
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX, SPEC_KEY
from ssl_lightning.evaluation.export_metadata import (
    NativeFormat,
    load_snippet,
    timm_pretrained_cfg,
    write_sidecar,
)
from ssl_lightning.io import atomic_path, run_directory

FitExportFormat = Literal["auto", "torchvision", "timm", "state_dict"]
_FIT_EXPORT_FORMATS = ("auto", "torchvision", "timm", "state_dict")


def native_format(backbone: nn.Module) -> NativeFormat:
    """The backbone's own format (:func:`~ssl_lightning.evaluation.export.backbone_format`, the
    rule of ``export --format auto``)."""
    from ssl_lightning.evaluation.export import backbone_format

    cls = type(backbone)
    return cast(NativeFormat, backbone_format(f"{cls.__module__}.{cls.__qualname__}",
                                              backbone.state_dict()))


class ExportBackbone(pl.Callback):
    """At the end of a finished ``fit``, export the backbone to ``<run dir>/export/backbone.pt``
    and print how to load it.

    Runs on global rank 0 only after a fit that ended normally (not after an exception, a
    pre-emption or Ctrl-C, not under ``fast_dev_run``). The run directory is
    :func:`~ssl_lightning.io.run_directory` (the folder of ``checkpoints/``);
    an MLflow / W&B logger also gets the file as the run's artifact ``export/backbone.pt``.
    The file is written to a temporary name and renamed, so a resumed run replaces the export
    of the run it continues.

    Args:
        format: ``"auto"`` (default): the backbone's own format (:func:`native_format`):
            ``"timm"`` for a ``TimmBackbone``, ``"torchvision"`` for a ResNet trunk, else
            ``"state_dict"``. Or one of those three, checked against the backbone when fit starts.
        prefix: Prefix of the exported module in the method's state dict
            (``"teacher_backbone."`` for the EMA teacher of DINO / BYOL / ...).
        enabled: ``False`` skips the export.
    """

    def __init__(self, format: FitExportFormat = "auto", prefix: str = DEFAULT_PREFIX,
                 enabled: bool = True) -> None:
        if format not in _FIT_EXPORT_FORMATS:
            raise ValueError(f"ExportBackbone format {format!r} is not one of "
                             f"{_FIT_EXPORT_FORMATS}; export ONNX / TorchScript with "
                             "`python -m ssl_lightning export` after fit.")
        if not prefix.endswith("."):
            raise ValueError(f"ExportBackbone prefix {prefix!r} must end with '.', e.g. "
                             f"{DEFAULT_PREFIX!r}.")
        self.format = format
        self.prefix = prefix
        self.enabled = enabled
        self.path: str | None = None
        self.snippet: str | None = None

    def _backbone(self, pl_module: pl.LightningModule) -> nn.Module:
        name = self.prefix[:-1]
        try:
            return pl_module.get_submodule(name)
        except AttributeError as err:
            children = [f"{child}." for child, _ in pl_module.named_children()]
            raise ValueError(
                f"ExportBackbone: {type(pl_module).__name__} has no module {name!r} (its modules:"
                f" {children}); set ExportBackbone(prefix=...) to one of them, or enabled=False."
            ) from err

    def _format(self, backbone: nn.Module) -> NativeFormat:
        native = native_format(backbone)
        if self.format == "auto":
            return native
        if self.format != "state_dict" and self.format != native:
            raise ValueError(
                f"ExportBackbone format {self.format!r} does not fit the backbone "
                f"{type(backbone).__name__} (its format is {native!r}); use format 'auto'."
            )
        return self.format

    @property
    def exported_backbone(self) -> str | None:
        """The exported file once this fit wrote it (read by
        :class:`~ssl_lightning.callbacks.RunSummary`)."""
        return self.path

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a prefix or format that does not fit before training starts."""
        if self.enabled and stage == "fit":
            self._format(self._backbone(pl_module))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or getattr(trainer, "fast_dev_run", False):
            return
        run_dir = run_directory(trainer)  # a broadcast under DDP: read on every rank
        state = full_state_dict(self._backbone(pl_module))  # sharded: gathered on every rank
        if not trainer.is_global_zero:
            return
        path = os.path.join(run_dir, "export", "backbone.pt")
        fmt = self._format(self._backbone(pl_module))
        record = preprocessing_record(getattr(trainer, "datamodule", None))
        self.snippet = export_module_backbone(
            pl_module, path, fmt, self.prefix, state,
            timm_pretrained_cfg(record) if record is not None else None)
        if record is not None:  # the export describes its input (export_metadata)
            write_sidecar(path, fmt, record, backbone_spec(self._backbone(pl_module)),
                          self.snippet)
        self.path = path
        print(f"Exported the backbone ({fmt} format) to "
              f"{path}. Load it with:\n{self.snippet}", flush=True)
        log_run_file(trainer, path, run_dir)


def export_module_backbone(module: nn.Module, output: str, fmt: NativeFormat,
                           prefix: str = DEFAULT_PREFIX,
                           backbone_state: Mapping[str, Tensor] | None = None,
                           pretrained_cfg: Mapping[str, Any] | None = None) -> str:
    """Export the ``prefix`` module of ``module`` to ``output`` in format ``fmt`` (through a
    temporary checkpoint read by ``export_state_dict``); returns the lines that load it.
    ``backbone_state``: that module's state when already gathered (sharded training);
    ``pretrained_cfg``: timm's preprocessing entries for the lines (see :func:`load_snippet`)."""
    from ssl_lightning.evaluation.export import export_state_dict

    if backbone_state is not None:
        state = {prefix + k: v for k, v in backbone_state.items()}
    else:
        state = {k: v for k, v in module.state_dict().items() if k.startswith(prefix)}
    spec = backbone_spec(module.get_submodule(prefix[:-1]))
    with tempfile.TemporaryDirectory(prefix="ssl_export_") as tmp:
        checkpoint = os.path.join(tmp, "backbone.ckpt")
        torch.save({"state_dict": state, SPEC_KEY: spec}, checkpoint)
        with atomic_path(output) as partial:
            exported = export_state_dict(checkpoint, str(partial), fmt, prefix)
    return load_snippet(fmt, output, exported, spec, pretrained_cfg)
