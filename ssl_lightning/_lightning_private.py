"""Lightning's private API, read in one place.

Lightning keeps a few things the package needs only in private attributes (the trainer a module
is attached to, the cluster environment, the signal handlers, the checkpoint being restored,
...). Each is read here by one small function that says what it is for; no other module names a
private attribute of Lightning (``tests/product/test_lightning_private.py`` scans the package
and fails naming any that does). The private methods of Lightning's classes that the package
overrides are in :data:`OVERRIDDEN`. On a Lightning upgrade, check these functions and those
overrides against the new release. The functions are duck-typed: this module imports nothing
from Lightning at run time (:mod:`ssl_lightning._lightning` re-exports them).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from lightning_fabric.plugins.environments import ClusterEnvironment
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.strategies import ModelParallelStrategy

#: ``Class.method`` of a Lightning class -> why the package's subclass overrides that private
#: method (the subclass names it; a test checks that every override is listed here).
OVERRIDDEN: dict[str, str] = {
    "LightningCLI._parse_ckpt_path": "SSLLightningCLI checks --ckpt_path against the config "
                                     "instead of loading the checkpoint's hyperparameters over it",
    "LightningCLI._run_subcommand": "SSLLightningCLI maps a run's errors to one error: line",
}


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None: ``module.trainer`` raises outside a fit,
    and methods, heads and checks also run in a plain PyTorch loop."""
    return module._trainer


def cluster_environment(trainer: pl.Trainer) -> ClusterEnvironment:
    """The cluster environment the Trainer chose (SLURM's requeue signal and auto-requeue
    setting, for the pre-emption callback): kept on its accelerator connector only."""
    return trainer._accelerator_connector.cluster_environment


def replace_sigterm_notifier(trainer: pl.Trainer, notifier: Any) -> None:
    """Replace the part of Lightning's SIGTERM handler that broadcasts and stops the run at the
    end of the batch, without a checkpoint (the pre-emption callback saves one first)."""
    trainer._signal_connector._sigterm_notifier_fn = notifier


def keep_signal_handlers(trainer: pl.Trainer, handlers: dict[int, Any]) -> None:
    """Make ``handlers`` the ones Lightning restores when its run ends (it saved the handlers in
    place when the fit started)."""
    trainer._signal_connector._original_handlers.update(handlers)


def accumulating(trainer: pl.Trainer) -> bool:
    """True while gradients accumulate: the batch just done is not the last one of an
    optimizer step (a stop waits for the step)."""
    return bool(trainer.fit_loop._should_accumulate())


def restored_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint the Trainer is restoring ({} when none), readable before the loops
    restore it (the data module builds its loader earlier and needs the epoch's progress)."""
    return getattr(trainer._checkpoint_connector, "_loaded_checkpoint", None) or {}


def full_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write (model, optimisers, loops,
    callbacks), built in memory: the divergence capture writes it with its own files."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def fit_train_dataloader(trainer: pl.Trainer) -> Any:
    """The fit's train loader, built now if Lightning has not built it yet (it does at the first
    epoch; ``configure_optimizers`` and the set-up checks need its batch size before that)."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    return trainer.train_dataloader


def drop_combined_loader(trainer: pl.Trainer) -> None:
    """Make the fit loop rebuild its train loader (after a sharded checkpoint is loaded, so the
    loader's restored state reaches a fresh loader)."""
    trainer.fit_loop._combined_loader = None


def checkpoint_intervals(callback: ModelCheckpoint) -> tuple[int, timedelta | None, int]:
    """``(every_n_train_steps, train_time_interval, every_n_epochs)`` as ``ModelCheckpoint``
    resolved its arguments (it keeps them private), for the run summary's checkpoint plan."""
    return (callback._every_n_train_steps, callback._train_time_interval,
            callback._every_n_epochs)


def initial_hyperparameters(module: pl.LightningModule) -> dict[str, Any]:
    """The hyperparameters ``save_hyperparameters`` recorded for the loggers (a copy of
    ``hparams`` taken then; renamed arguments are renamed in both)."""
    return module._hparams_initial


def device_mesh(module: pl.LightningModule) -> Any:
    """The device mesh ``ModelParallelStrategy`` gave the module (None under other strategies):
    the methods shard themselves on it in ``configure_model``."""
    return module._device_mesh


def before_batch_transfer(module: pl.LightningModule, batch: Any, dataloader_idx: int = 0) -> Any:
    """``on_before_batch_transfer`` of the data module and the module, as the fit loop calls
    them, for a batch of a loader the package iterates itself (a pass over the training set)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)


def cli_config_value(cli: LightningCLI, config: Any, key: str, default: Any = None) -> Any:
    """``key`` of the running subcommand's section of ``config`` (or of ``config`` itself without
    a subcommand), as LightningCLI reads it."""
    return cli._get(config, key, default=default)


def dumped_cli_config(cli: LightningCLI) -> dict[str, Any]:
    """The running subcommand's parsed config as plain data (``cli.config_dump``, which
    LightningCLI fills only in its own ``--ckpt_path`` step; a resume check compares the
    checkpoint's hyperparameters with it)."""
    cli._dump_config()
    return cli.config_dump


def set_data_parallel_size(strategy: ModelParallelStrategy, size: int) -> None:
    """Set the data-parallel dimension of ``ModelParallelStrategy``'s device mesh (it is fixed
    by a constructor argument; the sharded strategy sets it to all processes once they are
    known, before the mesh is built)."""
    strategy._data_parallel_size = size


def saves_distributed_checkpoint(strategy: ModelParallelStrategy) -> bool:
    """Whether ``ModelParallelStrategy`` writes sharded checkpoint directories (its
    ``save_distributed_checkpoint`` argument) rather than one file."""
    return bool(strategy._save_distributed_checkpoint)
