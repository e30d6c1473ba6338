"""The LightningCLI subclass behind :func:`ssl_lightning.cli.main`.

On top of LightningCLI it makes errors readable (see :mod:`ssl_lightning.cli.errors`), reads
an integer ``--trainer.limit_*_batches`` as a number of batches, runs without a logger (a
config's ``LearningRateMonitor`` is dropped then) or without a progress bar (its progress-bar
callback is dropped), and replaces LightningCLI's ``--ckpt_path``
handling, which loads the checkpoint's hyperparameters *over* the config (so ``--model`` and
``--model.*`` overrides were silently dropped), by the checks of :mod:`ssl_lightning.cli.resume`:
the config and the command line define the run, the checkpoint supplies its state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import reduce
from operator import or_
from pathlib import Path
from typing import Any

from torch import nn

from ssl_lightning._lightning import (
    CPUAccelerator,
    LearningRateMonitor,
    LightningArgumentParser,
    LightningCLI,
    ModelCheckpoint,
    ProgressBar,
    cli_config_value,
    dumped_cli_config,
    pl,
    rank_zero_info,
)
from ssl_lightning.backbones.spec import (
    SPEC_ATTRIBUTE,
    backbone_spec,
    config_class_paths,
    trust_classes,
)
from ssl_lightning.callbacks import DivergenceCapture, PreemptionCheckpoint
from ssl_lightning.cli.errors import (
    READABLE,
    CLIError,
    ReadableArgumentParser,
    constructor_error,
    debug_mode,
    one_line,
    run_error_message,
)
from ssl_lightning.cli.resume import (
    KEPT_ON_CHANGE,
    check_architecture,
    check_method_and_hyperparameters,
    check_strategy,
    keep_last_checkpoints,
    read_checkpoint,
)
from ssl_lightning.io import RunDirectoryLock, latest_checkpoint, with_atomic_checkpoint_io
from ssl_lightning.io.run_directory import local_run_directory

#: ``ckpt_path`` values Lightning resolves itself (no file to check here).
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")

#: Trainer arguments where an int counts batches and a float is a fraction (or an interval).
BATCH_COUNT_ARGUMENTS = ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                         "limit_predict_batches", "val_check_interval", "overfit_batches")


class SSLLightningCLI(LightningCLI):
    """LightningCLI with readable errors and a resume that keeps the config's model; without
    LightningCLI's automatic ``--optimizer`` / ``--lr_scheduler`` (each method configures its
    own optimiser and schedule)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._resume: tuple[str, Mapping[str, Any]] | None = None
        self._keep_original_run = False  # a resume with changed settings: keep its last.ckpt
        kwargs["parser_class"] = ReadableArgumentParser
        # no --optimizer / --lr_scheduler: they would replace the method's optimiser and schedule
        kwargs["auto_configure_optimizers"] = False
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Parse an integer of :data:`BATCH_COUNT_ARGUMENTS` as an int (a number of batches).

        Their type is ``int | float``, but ``typing`` caches unions regardless of the order of
        their members, so the Trainer's annotation can come out as ``float | int`` (an earlier
        import built that one first), and jsonargparse, which tries the members in order, then
        reads ``1`` as ``1.0`` (all batches). ``types.UnionType`` is not cached: the members are
        rebuilt with ``int`` first.
        """
        for action in parser._actions:
            members = getattr(getattr(action, "_typehint", None), "__args__", ())
            if (action.dest.removeprefix("trainer.") in BATCH_COUNT_ARGUMENTS
                    and int in members and float in members):
                # jsonargparse's ActionTypeHint (not public) parses with its _typehint
                action._typehint = reduce(  # type: ignore[attr-defined]
                    or_, [int, *(m for m in members if m is not int)])
        parser.add_argument(
            "--resume_in_place", type=bool, default=False,
            help="fit --ckpt_path with changed hyperparameters: continue in the checkpoint's run "
                 "folder and replace its last.ckpt (by default the original run is kept, see "
                 "docs/resume.md).")

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """LightningCLI's trainer, writing checkpoints atomically (unless the config names its
        own checkpoint IO) and holding its run directory (see :mod:`ssl_lightning.io`) from
        before the config is saved into it."""
        config = cli_config_value(self, self.config_init, "trainer", default={})
        kwargs.setdefault("plugins", with_atomic_checkpoint_io(config.get("plugins")))
        callbacks = config.get("callbacks")
        if config.get("enable_progress_bar") is False and isinstance(callbacks, list):
            # Lightning refuses a progress-bar callback with enable_progress_bar=False: the
            # config's is dropped, so the flag works on every shipped config.
            kwargs.setdefault("callbacks", [c for c in callbacks if not isinstance(c, ProgressBar)])
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.insert(0, RunDirectoryLock())  # type: ignore[attr-defined]
        if not any(isinstance(c, DivergenceCapture) for c in trainer.callbacks):  # type: ignore[attr-defined]
            trainer.callbacks.append(DivergenceCapture())  # type: ignore[attr-defined]
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` against the config (LightningCLI's version overwrote the
        config with the checkpoint's hyperparameters)."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path == "last":
            path = self._resolve_last()
        if not path or str(path).split(":")[0] in _LIGHTNING_CKPT_NAMES:
            return
        checkpoint = read_checkpoint(str(path))
        in_place = bool(self.config[subcommand].get("resume_in_place"))
        kept = ("--resume_in_place: this run continues in the checkpoint's run folder and "
                "replaces its last.ckpt." if in_place else KEPT_ON_CHANGE)
        changed = check_method_and_hyperparameters(
            checkpoint, str(path), dumped_cli_config(self).get("model") or {}, kept=kept)
        self._resume = (str(path), checkpoint)
        self._keep_original_run = changed and not in_place
        if not self._keep_original_run:
            self._continue_in_run_directory(str(path))

    def _resolve_last(self) -> str | None:
        """``--ckpt_path last``: the newest ``last.ckpt`` of the configured TensorBoard / CSV
        logger's runs (``<save_dir>/<name>/*/checkpoints/last.ckpt``), so the same command starts
        a run and resumes it after a requeue; no such file starts a new run. Other loggers keep
        Lightning's meaning of ``last`` (the current run's own checkpoint folder)."""
        subcommand = self.config["subcommand"]
        runs = self._logger_runs_folder()
        if runs is None:
            return "last"
        found = latest_checkpoint(runs, "last.ckpt")
        if found is None:
            rank_zero_info(f"--ckpt_path last: no {runs}/*/checkpoints/last.ckpt yet; starting "
                           "a new run.")
            self.config[subcommand]["ckpt_path"] = None
            return None
        rank_zero_info(f"--ckpt_path last: resuming from {found}")
        self.config[subcommand]["ckpt_path"] = str(found)
        return str(found)

    def _logger_runs_folder(self) -> Path | None:
        """``<save_dir>/<name>`` of the configured TensorBoard / CSV logger, None for others."""
        logger = self.config[self.config["subcommand"]]["trainer"].get("logger")
        init_args = getattr(logger, "init_args", None)
        class_path = str(getattr(logger, "class_path", ""))
        if init_args is None or not class_path.endswith(("TensorBoardLogger", "CSVLogger")):
            return None
        return Path(str(init_args.get("save_dir") or ".")).resolve() / str(
            init_args.get("name") or "lightning_logs")

    def _continue_in_run_directory(self, path: str) -> None:
        """A resumed run writes into the run directory of its checkpoint, not a new
        ``version_N``: when ``path`` is ``<save_dir>/<name>/<version>/checkpoints/<file>`` of the
        configured TensorBoard / CSV logger and the config sets no version, that version is
        used (``--trainer.logger.init_args.version`` chooses another)."""
        expected = self._logger_runs_folder()
        init_args = self.config[self.config["subcommand"]]["trainer"]["logger"].init_args \
            if expected is not None else None
        if init_args is None or init_args.get("version") is not None:
            return
        checkpoints = Path(path).resolve().parent
        run_dir = checkpoints.parent
        if checkpoints.name == "checkpoints" and run_dir.parent == expected:
            init_args["version"] = run_dir.name

    def instantiate_classes(self) -> None:
        """Build trainer, model and data; a constructor's error (also the Trainer's own
        ``MisconfigurationException``) is raised as its own message."""
        trust_classes(config_class_paths(self.config))  # a checkpoint may name them too
        try:
            super().instantiate_classes()
        except Exception as err:
            cause = constructor_error(err)
            if debug_mode():
                raise
            if not isinstance(cause, READABLE):  # a bug, not a setting: keep its traceback
                if cause is err:
                    raise
                raise cause from None
            raise CLIError(one_line(cause)) from err

    def after_instantiate_classes(self) -> None:
        """Pre-flight checks that would otherwise fail after processes were spawned."""
        if self._resume is not None:
            path, checkpoint = self._resume
            check_strategy(self.trainer.strategy, path)
            check_architecture(self.model, checkpoint, path)
            self._resume = None  # the checkpoint's tensors are no longer needed here
        if self.subcommand == "fit":
            self._check_sync_batchnorm()
            if self._keep_original_run:
                self._keep_last_checkpoints()
        self._drop_lr_monitor_without_logger()
        self._record_backbone_spec()

    def _run_subcommand(self, subcommand: str) -> None:
        """Run ``subcommand``; a setting refused while the run sets up, and an error of
        ssl_lightning's own types, are raised as their one-line message
        (:func:`~ssl_lightning.cli.errors.run_error_message`). A ``fit``'s stop signals are
        handled by its :class:`PreemptionCheckpoint` from here on, and after the fit finished
        they are only noted until the process exits (a finished run exits 0)."""
        if subcommand == "fit":
            for callback in self.trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, PreemptionCheckpoint):
                    callback.ignore_after_finish = True  # the process ends after the fit
                    callback.listen(self.trainer)  # also while the data is indexed
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            message = None if debug_mode() else run_error_message(err)
            if message is None:
                raise
            raise CLIError(message) from err

    def _keep_last_checkpoints(self) -> None:
        """Copy each ``last.ckpt`` this run would replace (in its checkpoint callbacks' folders)
        to ``last-before-resume[-N].ckpt``, on global rank 0 before anything is written."""
        if not self.trainer.is_global_zero:
            return
        default = os.path.join(local_run_directory(self.trainer), "checkpoints")
        folders = [c.dirpath or default for c in self.trainer.callbacks  # type: ignore[attr-defined]
                   if (isinstance(c, ModelCheckpoint) and c.save_last)
                   or isinstance(c, PreemptionCheckpoint)]
        for original, copy in keep_last_checkpoints(str(f) for f in folders):
            rank_zero_info(f"Kept the original run's {original} as {copy} (this resume changes "
                           "hyperparameters).")

    def _drop_lr_monitor_without_logger(self) -> None:
        """Without a logger (``--trainer.logger false``), Lightning refuses a
        ``LearningRateMonitor``: the config's is dropped, with a note."""
        if self.trainer.loggers:
            return
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]
        kept = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
        if len(kept) < len(callbacks):
            rank_zero_info("No logger (--trainer.logger false): the LearningRateMonitor of the "
                           "config is dropped (it only writes to a logger).")
            self.trainer.callbacks = kept  # type: ignore[attr-defined]

    def _record_backbone_spec(self) -> None:
        """Give a backbone that does not record its own arguments (a torchvision or user class
        named by ``class_path``) the spec of the config, so its checkpoints rebuild it."""
        backbone = getattr(self.model, "backbone", None)
        if not isinstance(backbone, nn.Module) or backbone_spec(backbone) is not None:
            return
        config = self.config[self.subcommand] if self.subcommand else self.config
        spec = ((config.get("model") or {}).get("init_args") or {}).get("backbone")
        if spec is not None and spec.get("class_path"):
            init_args = spec.get("init_args")
            setattr(backbone, SPEC_ATTRIBUTE, {
                "class_path": spec["class_path"],
                "init_args": dict(init_args.as_dict() if hasattr(init_args, "as_dict")
                                  else init_args or {}),
            })

    def _check_sync_batchnorm(self) -> None:
        trainer_config = self.config["fit"].get("trainer") or {}
        if not trainer_config.get("sync_batchnorm") or self.trainer.world_size < 2:
            return
        has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                            for m in self.model.modules())
        if has_batchnorm and isinstance(self.trainer.accelerator, CPUAccelerator):
            raise CLIError(
                f"sync_batchnorm: true needs GPUs (SyncBatchNorm does not run on CPU), and this "
                f"run has {self.trainer.world_size} CPU processes. Pass "
                "--trainer.sync_batchnorm false (each process then normalises over its own "
                "batch), or run on GPUs."
            )
