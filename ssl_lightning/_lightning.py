"""The one place Lightning is imported from, ``pytorch_lightning`` or ``lightning.pytorch``.

The two distributions ship the same code under two names, and their classes are distinct:
``lightning.Trainer`` rejects a ``pytorch_lightning.LightningModule``. So the package's methods,
callbacks and data modules must derive from the namespace the user's ``Trainer`` comes from. It
is chosen once, when ``ssl_lightning`` is first imported, by the first rule that applies:

1. ``SSL_LIGHTNING_NAMESPACE=lightning`` or ``=pytorch_lightning`` in the environment;
2. ``lightning`` already imported and ``pytorch_lightning`` not (``import lightning as L`` above
   ``import ssl_lightning``, the order isort writes);
3. ``pytorch_lightning`` if it is installed, else ``lightning``.

Every other module imports Lightning names from here, never from either package directly, so
one process never mixes the two. :data:`NAMESPACE` says which one was chosen. The few private
attributes of Lightning that the package reads are read by the small functions of
:mod:`ssl_lightning._lightning_private`, re-exported here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING

#: The environment variable that chooses the namespace.
NAMESPACE_VARIABLE = "SSL_LIGHTNING_NAMESPACE"

#: Accepted values -> (the Trainer's package, its fabric package).
_PACKAGES: dict[str, tuple[str, str]] = {
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
    "lightning": ("lightning.pytorch", "lightning.fabric"),
}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def choose_namespace(environ: dict[str, str] | os._Environ[str] = os.environ,
                     imported: frozenset[str] | None = None) -> str:
    """The Lightning distribution to use: ``"pytorch_lightning"`` or ``"lightning"``.

    Args:
        environ: Where :data:`NAMESPACE_VARIABLE` is read.
        imported: Names of the modules already imported (default ``sys.modules``).

    Raises:
        ImportError: The variable names something else, or the chosen package is not installed.
    """
    loaded = frozenset(sys.modules) if imported is None else imported
    wanted = environ.get(NAMESPACE_VARIABLE, "").strip()
    if wanted == "lightning.pytorch":
        wanted = "lightning"
    if wanted and wanted not in _PACKAGES:
        raise ImportError(f"{NAMESPACE_VARIABLE}={wanted!r}: expected 'lightning' (for "
                          "`import lightning as L`) or 'pytorch_lightning'")
    if not wanted:
        if "lightning" in loaded and "pytorch_lightning" not in loaded:
            wanted = "lightning"
        elif _installed("pytorch_lightning"):
            wanted = "pytorch_lightning"
        else:
            wanted = "lightning"
    if not _installed(wanted):
        asked = bool(environ.get(NAMESPACE_VARIABLE))
        chosen = f"{NAMESPACE_VARIABLE}={wanted}, but it" if asked \
            else "pytorch_lightning (or lightning)"
        package = wanted if asked else "pytorch_lightning"
        raise ImportError(f"ssl_lightning runs on Lightning, and {chosen} is not installed: "
                          f"`pip install {package.replace('_', '-')}`")
    return wanted


#: ``"pytorch_lightning"`` or ``"lightning"``: the distribution this process uses.
NAMESPACE: str = choose_namespace()
#: The package the Trainer comes from: ``pytorch_lightning`` or ``lightning.pytorch``.
PACKAGE, FABRIC_PACKAGE = _PACKAGES[NAMESPACE]

if TYPE_CHECKING:  # static types come from pytorch_lightning; both packages are the same code
    import pytorch_lightning as pl
    from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning_fabric.plugins.environments import SLURMEnvironment
    from lightning_fabric.utilities.cloud_io import get_filesystem
    from lightning_fabric.utilities.exceptions import MisconfigurationException
    from lightning_fabric.utilities.types import _PATH
    from pytorch_lightning import callbacks
    from pytorch_lightning.accelerators import CPUAccelerator
    from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar
    from pytorch_lightning.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
    from pytorch_lightning.loggers import (
        CSVLogger,
        MLFlowLogger,
        TensorBoardLogger,
        WandbLogger,
    )
    from pytorch_lightning.loops import training_epoch_loop
    from pytorch_lightning.strategies import ModelParallelStrategy
    from pytorch_lightning.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
    from pytorch_lightning.utilities.exceptions import SIGTERMException
    from pytorch_lightning.utilities.seed import isolate_rng
else:
    #: Exported name -> (True for the fabric package, its submodule, its attribute or "").
    _SYMBOLS: dict[str, tuple[bool, str, str]] = {
        "CheckpointIO": (True, "plugins", "CheckpointIO"),
        "TorchCheckpointIO": (True, "plugins", "TorchCheckpointIO"),
        "SLURMEnvironment": (True, "plugins.environments", "SLURMEnvironment"),
        "get_filesystem": (True, "utilities.cloud_io", "get_filesystem"),
        "MisconfigurationException": (True, "utilities.exceptions", "MisconfigurationException"),
        "_PATH": (True, "utilities.types", "_PATH"),
        "callbacks": (False, "callbacks", ""),
        "CPUAccelerator": (False, "accelerators", "CPUAccelerator"),
        "LearningRateMonitor": (False, "callbacks", "LearningRateMonitor"),
        "ModelCheckpoint": (False, "callbacks", "ModelCheckpoint"),
        "ProgressBar": (False, "callbacks", "ProgressBar"),
        "LightningArgumentParser": (False, "cli", "LightningArgumentParser"),
        "LightningCLI": (False, "cli", "LightningCLI"),
        "SaveConfigCallback": (False, "cli", "SaveConfigCallback"),
        "CSVLogger": (False, "loggers", "CSVLogger"),
        "MLFlowLogger": (False, "loggers", "MLFlowLogger"),
        "TensorBoardLogger": (False, "loggers", "TensorBoardLogger"),
        "WandbLogger": (False, "loggers", "WandbLogger"),
        "training_epoch_loop": (False, "loops.training_epoch_loop", ""),
        "ModelParallelStrategy": (False, "strategies", "ModelParallelStrategy"),
        "rank_zero_info": (False, "utilities", "rank_zero_info"),
        "rank_zero_only": (False, "utilities", "rank_zero_only"),
        "rank_zero_warn": (False, "utilities", "rank_zero_warn"),
        "SIGTERMException": (False, "utilities.exceptions", "SIGTERMException"),
        "isolate_rng": (False, "utilities.seed", "isolate_rng"),
    }
    pl = import_module(PACKAGE)
    for _name, (_fabric, _module, _attribute) in _SYMBOLS.items():
        _found = import_module(f"{FABRIC_PACKAGE if _fabric else PACKAGE}.{_module}")
        globals()[_name] = getattr(_found, _attribute) if _attribute else _found

from ssl_lightning._lightning_private import (  # noqa: E402  (after the namespace is chosen)
    OVERRIDDEN,
    accumulating,
    attached_trainer,
    before_batch_transfer,
    checkpoint_intervals,
    cli_config_value,
    cluster_environment,
    device_mesh,
    drop_combined_loader,
    dumped_cli_config,
    fit_train_dataloader,
    full_checkpoint,
    initial_hyperparameters,
    keep_signal_handlers,
    replace_sigterm_notifier,
    restored_checkpoint,
    saves_distributed_checkpoint,
    set_data_parallel_size,
)

__all__ = [
    "NAMESPACE", "NAMESPACE_VARIABLE", "PACKAGE", "FABRIC_PACKAGE", "choose_namespace", "pl",
    "CheckpointIO", "TorchCheckpointIO", "SLURMEnvironment", "get_filesystem",
    "MisconfigurationException", "_PATH", "callbacks", "CPUAccelerator", "LearningRateMonitor",
    "ModelCheckpoint", "ProgressBar", "LightningArgumentParser", "LightningCLI",
    "SaveConfigCallback", "CSVLogger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger",
    "training_epoch_loop", "ModelParallelStrategy", "rank_zero_info", "rank_zero_only",
    "rank_zero_warn",
    "SIGTERMException", "isolate_rng",
    "OVERRIDDEN",
    "accumulating",
    "attached_trainer",
    "before_batch_transfer",
    "checkpoint_intervals",
    "cli_config_value",
    "cluster_environment",
    "device_mesh",
    "drop_combined_loader",
    "dumped_cli_config",
    "fit_train_dataloader",
    "full_checkpoint",
    "initial_hyperparameters",
    "keep_signal_handlers",
    "replace_sigterm_notifier",
    "restored_checkpoint",
    "saves_distributed_checkpoint",
    "set_data_parallel_size",
]
