"""The product matrix: every shipped config through the real CLI, then resumed from last.ckpt.

Used by ``tests/product/test_product_matrix.py``; also a script. One driver process per rank
runs every config in turn (``python tests/product_matrix.py SPEC.json OUT_DIR``): with
``WORLD_SIZE=2`` the two drivers are started like ``torchrun`` would start them
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), join one gloo
process group, and each config runs with ``--trainer.strategy ddp`` in the already-initialised
group. So the whole matrix costs one start-up (imports, process group) per rank instead of one
``ddp_spawn`` per config.

A config runs as shipped, with only sizes shrunk (:func:`shrink_args`): a small backbone, small
heads, the tiny image folder, batch 4, 2 training batches per epoch, validation every epoch.
The first leg is the config's 2-epoch schedule stopped after epoch 1 (:class:`MatrixProbe`);
the resume leg reruns the same command with ``--ckpt_path last.ckpt`` and must start at the
saved ``global_step`` and finish the schedule. A config that needs more registers it in
``EXTRA_ARGS`` (extra CLI arguments; a method's come from ``matrix_args`` of its registry entry),
``SUBCOMMANDS`` (not ``fit``) or ``CHECKPOINT_FROM`` (the config whose ``last.ckpt`` it evaluates,
or distils: ``CHECKPOINT_ARGUMENTS`` names the model argument that receives it). ``COMPOSED`` legs
run a config with shared pieces composed after it (``--config dinov3.yaml --config
shared/fsdp.yaml``) on 2 processes, with their strategy.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import yaml

from ssl_lightning.methods.registry import method_entries

ROOT = Path(__file__).resolve().parents[1]
#: Configs left out of the matrix, with where they are run instead.
SKIP: dict[str, str] = {
    "dinov3_continue.yaml": "tests/product/test_configs.py runs it with a released-backbone "
                            "file; its method runs here as dinov3.yaml",
    "neco.yaml": "tests/product/test_configs.py runs it with a released-backbone file "
                 "(a post-training method: it starts from released weights)",
    **{name: "tests/product/test_configs.py runs it on synthetic dense data (image + mask/depth "
             "pairs, not the tiny class folder); the 2-process sums of its metrics are "
             "tests/evaluation/test_dense_metrics.py's"
       for name in ("seg_linear.yaml", "seg_knn.yaml", "depth_linear.yaml")},
}
CONFIGS = [c for c in sorted((ROOT / "configs").glob("*.yaml")) if c.name not in SKIP]

#: Extra CLI arguments of a config (after the generic shrinking): the evaluation configs' here,
#: a method's from its registry entry (``matrix_args``, in the method's file).
EXTRA_ARGS: dict[str, list[str]] = {
    "fewshot.yaml": ["--model.init_args.shots", "[1, 2]", "--model.init_args.draws", "2"],
    "linear_grid.yaml": ["--model.init_args.last_blocks", "[1]"],  # of the 1-block ViT
    **{config: list(args) for entry in method_entries() for config, args in
       entry.matrix_args.items()},
}
#: Legs of the 2-process driver: a config with shared pieces composed after it (their strategy
#: replaces ``ddp``); the sharded leg writes distributed-checkpoint directories.
COMPOSED: dict[str, tuple[str, list[str]]] = {
    "dinov3.yaml+fsdp.yaml": ("dinov3.yaml", ["shared/fsdp.yaml"]),
}
#: The config also run on litdata shards of the tiny image folder (``spec["shards"]``), composed
#: with ``configs/shared/streaming.yaml``, under the name :data:`STREAMING_RUN`.
STREAMING_CONFIG = "simclr.yaml"
STREAMING_RUN = "simclr.yaml+shards"
STREAMING_PIECE = "shared/streaming.yaml"
#: The LightningCLI subcommand of a config when it is not ``fit`` (no resume leg then).
SUBCOMMANDS: dict[str, str] = {"knn.yaml": "validate", "fewshot.yaml": "validate"}
#: Evaluation configs: the pre-training config whose ``last.ckpt`` they are given.
CHECKPOINT_FROM: dict[str, str] = {"linear.yaml": "simclr.yaml", "knn.yaml": "simclr.yaml",
                                   "fewshot.yaml": "simclr.yaml",
                                   "linear_grid.yaml": "moco_v3_vit.yaml",
                                   "attentive.yaml": "moco_v3_vit.yaml",
                                   "distillation.yaml": "dino.yaml"}
#: The model argument that receives the ``CHECKPOINT_FROM`` checkpoint (default ``checkpoint``).
CHECKPOINT_ARGUMENTS: dict[str, str] = {"distillation.yaml": "teacher_checkpoint"}

SMALL_CONVNET = '{"class_path": "ssl_lightning.SmallConvNet", "init_args": {"widths": [8, 16]}}'
STEPS_PER_EPOCH = 2
EPOCHS = 2


class MatrixProbe(pl.Callback):
    """Records the ``global_step`` a fit starts from; optionally stops after some epochs."""

    start_step: int | None = None

    def __init__(self, stop_after_epochs: int = 0) -> None:
        self.stop_after_epochs = stop_after_epochs

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        MatrixProbe.start_step = trainer.global_step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stop_after_epochs and trainer.current_epoch + 1 >= self.stop_after_epochs:
            trainer.should_stop = True


def shrink_args(config: Path, data_root: Path, world_size: int, own_strategy: bool = False,
                shards: Path | None = None) -> list[str]:
    """CLI arguments that shrink ``config`` to a seconds-long CPU run (1 or 2 processes; DDP
    unless ``own_strategy``: a composed piece selects the strategy), on ``data_root`` or on its
    ``shards`` (``shards/train``, ``shards/test``)."""
    declared = yaml.safe_load(config.read_text())
    model = declared["model"].get("init_args") or {}
    args: list[str] = []
    backbone = str((model.get("backbone") or {}).get("class_path", ""))
    if backbone.rpartition(".")[2] in ("ResNet", "TorchvisionBackbone"):
        args += ["--model.init_args.backbone", SMALL_CONVNET]
    elif backbone.rpartition(".")[2] == "ViT":
        prefix = "--model.init_args.backbone.init_args."
        args += [prefix + "embed_dim", "32", prefix + "depth", "1", prefix + "num_heads", "2"]
    for key, value in model.items():  # head widths
        if isinstance(value, int) and not isinstance(value, bool) and key.endswith("_dim"):
            small = 32 if key.endswith("hidden_dim") else 64
            if value > small:
                args += [f"--model.init_args.{key}", str(small)]
    args += (["--data.init_args.root", str(data_root)] if shards is None else
             ["--data.init_args.train_shards", str(shards / "train"),
              "--data.init_args.val_shards", str(shards / "test")])
    args += ["--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0"]
    args += ["--trainer.accelerator", "cpu", "--trainer.devices", str(world_size),
             "--trainer.precision", "32-true", "--trainer.max_epochs", str(EPOCHS),
             "--trainer.limit_train_batches", str(STEPS_PER_EPOCH),
             "--trainer.check_val_every_n_epoch", "1", "--trainer.log_every_n_steps", "1",
             "--trainer.num_sanity_val_steps", "0"]
    if world_size > 1 and not own_strategy:
        args += ["--trainer.strategy", "ddp", "--trainer.sync_batchnorm", "false"]
    return args + EXTRA_ARGS.get(config.name, [])


def probe_arg(stop_after_epochs: int) -> list[str]:
    """The CLI argument that appends a :class:`MatrixProbe` to the config's callbacks."""
    probe = {"class_path": "product_matrix.MatrixProbe",
             "init_args": {"stop_after_epochs": stop_after_epochs}}
    return [f"--trainer.callbacks+={json.dumps(probe)}"]


def _last_checkpoint(workdir: Path) -> str:
    found = sorted(glob.glob(str(workdir / "**" / "last.ckpt"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no last.ckpt under {workdir}")
    return found[-1]


def _saved_step(checkpoint: str) -> int:
    """``global_step`` of a checkpoint file or of a sharded checkpoint directory."""
    import torch

    from ssl_lightning.distributed.sharding import META_FILE, is_sharded_checkpoint

    path = Path(checkpoint) / META_FILE if is_sharded_checkpoint(checkpoint) else checkpoint
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def run_config(config: Path, workdir: Path, data_root: Path, world_size: int,
               checkpoints: dict[str, str], extra: list[str] | None = None,
               composed: list[str] | None = None, own_strategy: bool = False,
               shards: Path | None = None) -> dict[str, Any]:
    """Run one config (and its resume leg), with the ``composed`` pieces of ``configs/`` after
    it (``own_strategy``: they select the strategy), on ``shards`` if given; returns what the
    test checks."""
    from ssl_lightning.cli import main
    from ssl_lightning.distributed.sharding import is_sharded_checkpoint

    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    subcommand = SUBCOMMANDS.get(config.name, "fit")
    pieces = [arg for piece in composed or []
              for arg in ("--config", str(ROOT / "configs" / piece))]
    args = [subcommand, "--config", str(config), *pieces,
            *shrink_args(config, data_root, world_size, own_strategy, shards)]
    if config.name in CHECKPOINT_FROM:
        source = CHECKPOINT_FROM[config.name]
        if source not in checkpoints:
            raise RuntimeError(f"{config.name} evaluates the checkpoint of {source}, which did not "
                               "run or failed (see its error).")
        argument = CHECKPOINT_ARGUMENTS.get(config.name, "checkpoint")
        args += [f"--model.init_args.{argument}", checkpoints[source]]
    result: dict[str, Any] = {}
    if extra:  # a check that is expected to raise (the divergence run)
        main(args + extra)
        return result
    if subcommand != "fit":
        cli = main(args)
        result.update(finished=cli.trainer.state.finished, world_size=cli.trainer.world_size,
                      metrics={k: float(v) for k, v in cli.trainer.callback_metrics.items()})
        return result
    cli = main(args + probe_arg(stop_after_epochs=1))
    last = _last_checkpoint(workdir)
    checkpoints[config.name] = last
    result.update(first_step=cli.trainer.global_step, saved_step=_saved_step(last),
                  sharded_checkpoint=is_sharded_checkpoint(last),
                  strategy=type(cli.trainer.strategy).__name__)
    MatrixProbe.start_step = None
    cli = main(args + probe_arg(stop_after_epochs=0) + ["--ckpt_path", last])
    result.update(resume_start=MatrixProbe.start_step, final_step=cli.trainer.global_step,
                  finished=cli.trainer.state.finished, world_size=cli.trainer.world_size,
                  metrics={k: float(v) for k, v in cli.trainer.callback_metrics.items()})
    return result


def _ordered(configs: list[Path]) -> list[Path]:
    """Pre-training configs first, then the ones that evaluate their checkpoints."""
    return sorted(configs, key=lambda c: c.name in CHECKPOINT_FROM)


def drive(spec: dict[str, Any], out_dir: Path) -> None:
    """Run every config of ``spec`` on this rank; write ``out_dir/rank<r>.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:  # Lightning's DDP strategy reuses this group for every config
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    results: dict[str, Any] = {}
    checkpoints: dict[str, str] = {}
    out = out_dir / f"rank{rank}.json"
    runs: list[tuple[str, Path, list[str] | None, list[str] | None]] = [
        (c.name, c, None, None) for c in _ordered([Path(c) for c in spec["configs"]])]
    runs += [(leg, ROOT / "configs" / COMPOSED[leg][0], None, COMPOSED[leg][1])
             for leg in spec.get("composed", [])]
    if spec.get("shards"):
        runs.append((STREAMING_RUN, ROOT / "configs" / STREAMING_CONFIG, None, [STREAMING_PIECE]))
    if spec.get("diverge"):
        runs.append(("__diverge__", ROOT / "configs" / "simclr.yaml", spec["diverge"], None))
    for name, config, extra, composed in runs:
        results[name] = {"status": "running"}
        out.write_text(json.dumps(results, indent=1))
        try:
            workdir = Path(spec["workdir"]) / name.replace(".yaml", "")
            shards = Path(spec["shards"]) if name == STREAMING_RUN else None
            result = run_config(config, workdir, Path(spec["data_root"]), world_size,
                                checkpoints, extra, composed, own_strategy=name in COMPOSED,
                                shards=shards)
            results[name] = {"status": "ok", **result}
        except BaseException as caught:  # noqa: BLE001 (reported per config)
            err = _innermost(caught)  # the CLI's exit(1) and its one-line error wrap the cause
            step = str(err).split("at global step ")[1].split()[0] if "at global step " in str(
                err) else None
            results[name] = {"status": "error", "error": traceback.format_exc(),
                             "type": type(err).__name__, "step": step}
            if isinstance(err, KeyboardInterrupt) or "timed out" in str(err).lower():
                out.write_text(json.dumps(results, indent=1))
                raise
        out.write_text(json.dumps(results, indent=1))


def _innermost(err: BaseException) -> BaseException:
    """The exception at the bottom of the ``raise ... from`` chain."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


if __name__ == "__main__":  # through the module, so that MatrixProbe is the class the CLI loads
    import product_matrix

    product_matrix.drive(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]).resolve())
