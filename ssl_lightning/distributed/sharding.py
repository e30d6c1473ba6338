"""Sharded (FSDP2) training: the one place that knows how a method is sharded.

Parameters, gradients and optimiser state are split across the data-parallel processes with
PyTorch's ``fully_shard`` (FSDP2, Zhao et al., "PyTorch FSDP", VLDB 2023), run through
Lightning's :class:`~pytorch_lightning.strategies.ModelParallelStrategy`, whose
``configure_model`` hook calls :func:`shard_method`. Every transformer block (the children of a
``blocks`` list: ViT, MAE decoder, I-JEPA predictor) and residual stage (``layer1`` ... ``layer4``)
is one unit, each top-level module of the method (backbone, heads, teachers) the root of its
units; an EMA teacher is wrapped exactly like its student, so the pairs' local shards line up
and the EMA update runs on them (:func:`local_tensor`) without a collective, as in DINOv2's
``dinov2/fsdp`` and DINOv3. Gradients are reduce-scattered as averages over the processes, like
DDP's, so the method's gathers (embeddings, queues, centres, Sinkhorn, KoLeo) are unchanged.

:class:`ShardedStrategy` is the strategy to select (``configs/shared/fsdp.yaml``): one
data-parallel dimension over all processes, optional activation checkpointing of the units and
the bf16 mixed-precision policy, distributed-checkpoint directories written complete or not
at all, and DDP's buffer rule (rank 0's unsharded buffers broadcast before each step and saved).
Lightning's own ``ModelParallelStrategy`` is refused (:func:`require_sharded_strategy`); every
sharded directory is read through :mod:`ssl_lightning.io.distributed_checkpoint`.
docs/distributed.md ("Sharded training") describes the checkpoint format and
``python -m ssl_lightning consolidate``.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ssl_lightning._lightning import (
    ModelParallelStrategy,
    attached_trainer,
    drop_combined_loader,
    saves_distributed_checkpoint,
    set_data_parallel_size,
)
from ssl_lightning.io.distributed_checkpoint import METADATA_FILE, load_state, read_metadata

_STAGE = re.compile(r"layer\d+")
#: The non-tensor part of a distributed checkpoint (Lightning's name).
META_FILE = "meta.pt"


def local_tensor(t: Tensor) -> Tensor:
    """This process's shard of a sharded (DTensor) parameter or buffer; ``t`` itself otherwise.
    In-place updates of the result update the sharded tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def copy_full(target: Tensor, value: Tensor) -> None:
    """``target.copy_(value)`` for a full ``value`` that every process holds alike (e.g.
    k-means centroids): a sharded ``target`` takes its own shard of it, without communication."""
    if isinstance(target, DTensor):
        value = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None)
    target.copy_(value)


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a sharded (DTensor) parameter or buffer."""
    return isinstance(t, DTensor)


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with sharded tensors gathered to full ones. A collective when
    ``module`` is sharded: every process calls it."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in module.state_dict().items()}


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are split alike: both unsharded, or DTensors on the same mesh
    with the same placements (so their local shards hold the same slices)."""
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        return a.device_mesh == b.device_mesh and a.placements == b.placements
    return not isinstance(a, DTensor) and not isinstance(b, DTensor)


def layout_name(t: Tensor) -> str:
    """``"unsharded"`` or the DTensor placements of ``t``, for error messages."""
    return f"sharded {t.placements}" if isinstance(t, DTensor) else "unsharded"


def shard_units(module: nn.Module) -> Iterator[nn.Module]:
    """The units of ``module`` below its root: transformer blocks (children of an
    ``nn.ModuleList`` named ``blocks``) and residual stages (``layer<k>`` submodules)."""
    for name, child in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if _STAGE.fullmatch(leaf) or (leaf.isdigit() and parent.rsplit(".", 1)[-1] == "blocks"):
            yield child


def sharded_paths(module: nn.Module) -> list[str]:
    """Paths of the ``fully_shard`` units inside ``module`` ("" for ``module`` itself)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def shard_method(method: nn.Module, mesh: Any, activation_checkpointing: bool = False,
                 mixed_precision: bool = False) -> None:
    """Shard ``method`` in place over the 1-D data-parallel ``mesh`` (see the module doc).

    Every process first takes rank 0's weights and buffers (as DDP does when it wraps a model),
    so processes that built their models from different seeds still train one model.

    Args:
        method: The LightningModule; each child module with parameters becomes a root.
        mesh: The data-parallel device mesh (``ModelParallelStrategy.device_mesh``).
        activation_checkpointing: Recompute each unit's activations in the backward pass.
        mixed_precision: bf16 parameters in forward/backward, fp32 gradient reduction.

    Raises:
        ValueError: a parameter registered on ``method`` itself (outside any child), which no
            unit would hold, or an EMA teacher whose units differ from its student's.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    own = [name for name, _ in method.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"{type(method).__name__} registers parameters {own} on itself; for "
                         "sharded training put them in a submodule (a head), which is sharded.")
    if mesh.ndim > 1:  # ModelParallelStrategy's (data_parallel, tensor_parallel) mesh
        mesh = mesh["data_parallel"]
    group = mesh.get_group()
    with torch.no_grad():
        for tensor in [*method.parameters(), *method.buffers()]:
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    options: dict[str, Any] = {"mesh": mesh}
    if mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    for child in _roots(method):
        for unit in list(shard_units(child)):
            if activation_checkpointing:
                _checkpoint_forward(unit)
            fully_shard(unit, **options)
        # A root keeps its parameters gathered after forward unless told (a teacher, which has
        # no backward to reshard it, would stay unsharded).
        fully_shard(child, reshard_after_forward=True, **options)
        _register_forward_methods(child)
    pairs: list[tuple[nn.Module, nn.Module]] = getattr(method, "ema_pairs", list)()
    check_same_sharding(pairs)


def broadcast_buffers(module: nn.Module) -> None:
    """Copy global rank 0's unsharded buffers of ``module`` to every process (one broadcast per
    dtype; sharded buffers are left alone). A collective: every process calls it."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for buffer in module.buffers():
        if not isinstance(buffer, DTensor) and buffer.numel():
            by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    with torch.no_grad():
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src=0)
            for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers]),
                                     strict=True):
                buffer.copy_(value.view_as(buffer))


def require_sharded_strategy(strategy: object) -> None:
    """Refuse a ``ModelParallelStrategy`` that is not :class:`ShardedStrategy` (Lightning's own
    class, as its docs show it): its loader cannot resume a method with a parameter that had no
    optimiser state when the checkpoint was written (DINO's last layer, frozen in the first
    epoch), and its checkpoints are not written complete-or-absent.

    Raises:
        ValueError: naming ``configs/shared/fsdp.yaml``.
    """
    if isinstance(strategy, ModelParallelStrategy) and not isinstance(strategy, ShardedStrategy):
        raise ValueError(
            f"{type(strategy).__name__}: the methods shard under "
            "ssl_lightning.distributed.sharding.ShardedStrategy, Lightning's "
            "ModelParallelStrategy with a loader that resumes layers without optimiser state "
            "yet (DINO's frozen last layer) and atomic checkpoint directories; Lightning's own "
            "class cannot resume every method. Compose configs/shared/fsdp.yaml after the "
            "method's config (--config configs/shared/fsdp.yaml), or"
            " pass strategy=ShardedStrategy() in Python."
        )


def _roots(module: nn.Module) -> Iterator[nn.Module]:
    """The children of ``module`` that hold parameters, with a container without a forward of
    its own (``nn.ModuleList`` / ``nn.ModuleDict``, e.g. DeepCluster v2's prototype heads)
    replaced by its own roots."""
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _roots(child)
        else:
            yield child


def check_same_sharding(pairs: Sequence[tuple[nn.Module, nn.Module]]) -> None:
    """``ValueError`` unless every ``(student, teacher)`` pair has the same ``fully_shard``
    units, so that their local shards hold the same slices of the same parameters."""
    for student, teacher in pairs:
        s, t = sharded_paths(student), sharded_paths(teacher)
        if s != t:
            raise ValueError(
                f"EMA teacher {type(teacher).__name__} is sharded as units {t or 'none'} but its "
                f"student as {s or 'none'}; wrap both with "
                "ssl_lightning.distributed.sharding.shard_method so their local shards line up."
            )


def _checkpoint_forward(unit: nn.Module) -> None:
    """Recompute ``unit``'s forward in the backward pass (non-reentrant activation
    checkpointing; the parameters' unshard/reshard hooks run again in the recomputation)."""
    from torch.utils.checkpoint import checkpoint

    forward = unit.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    unit.forward = checkpointed  # type: ignore[method-assign]


def _register_forward_methods(root: nn.Module) -> None:
    """Let the methods' other entry points (``forward_tokens``, ``forward_features``, ...) of
    ``root`` gather its parameters like ``forward`` does."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in dir(type(root)):
        if name.startswith("forward_") and callable(getattr(root, name, None)):
            register_fsdp_forward_method(root, name)


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a distributed-checkpoint directory (``meta.pt`` + ``.metadata``)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / METADATA_FILE).is_file()


def incomplete_checkpoint_directory(path: str | os.PathLike[str]) -> str:
    """What is wrong with the directory ``path`` as a sharded checkpoint (for messages)."""
    missing = [name for name in (META_FILE, METADATA_FILE) if not (Path(path) / name).is_file()]
    return (f"{os.fspath(path)!r} is a directory without {' and '.join(missing)}, so not a "
            f"complete sharded checkpoint (one holds {META_FILE}, {METADATA_FILE} and a "
            "__<rank>_0.distcp shard per process); pass a checkpoint file, or a complete "
            "sharded checkpoint directory.")


def load_sharded_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The distributed checkpoint directory ``path`` as one checkpoint dict on one process,
    without a process group: its ``meta.pt`` (loops, callbacks, hyperparameters, backbone
    spec, rng seed) plus the full ``state_dict`` assembled from every process's shard, read as
    data (:mod:`ssl_lightning.io.distributed_checkpoint`). Optimiser states are left out (a
    consolidated checkpoint is for evaluation and export).

    Raises:
        ValueError: ``path`` is not a complete distributed checkpoint directory, or one of its
            files is refused or damaged (the message names the file).
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    from ssl_lightning.io.torch_files import load_torch_data

    if not Path(path).is_dir():
        raise ValueError(f"{os.fspath(path)!r} is not a directory; name a sharded checkpoint "
                         "directory (e.g. runs/<name>/version_N/checkpoints/last.ckpt).")
    if not is_sharded_checkpoint(path):
        raise ValueError(incomplete_checkpoint_directory(path))
    meta = os.fspath(Path(path) / META_FILE)
    checkpoint = load_torch_data(meta, "The sharded checkpoint's", "Use another checkpoint "
                                 "(an earlier one beside it), or write this one again.")
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{meta!r} holds a {type(checkpoint).__name__}, not the checkpoint "
                         "dict a sharded checkpoint's meta.pt holds.")
    shards: dict[str, Any] = {}
    load_state(shards, path, planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}),
               no_dist=True)
    checkpoint["state_dict"] = shards.get("state_dict", {})
    return checkpoint


class ShardedStrategy(ModelParallelStrategy):
    """Lightning's :class:`ModelParallelStrategy` as FSDP2 over all processes.

    ``data_parallel_size`` is the world size (devices x nodes), ``tensor_parallel_size`` 1; the
    checkpoint is a distributed-checkpoint directory (one shard file per process plus
    ``meta.pt``), written to a temporary directory beside it and renamed, so an interrupted save
    leaves the previous checkpoint.

    Args:
        activation_checkpointing: Recompute every block's / stage's activations in the backward
            pass (less memory, one more forward).
        mixed_precision: bf16 parameters in forward and backward, fp32 gradient reduction
            (``MixedPrecisionPolicy``; GPUs). Use with ``precision: 32-true``.
        save_distributed_checkpoint: False: one full checkpoint file assembled on rank 0.
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on GPUs; None: from the device.
    """

    def __init__(self, activation_checkpointing: bool = False, mixed_precision: bool = False,
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend)
        self.activation_checkpointing = activation_checkpointing
        self.mixed_precision = mixed_precision

    def setup_environment(self) -> None:
        set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The method's training step, after every process took rank 0's unsharded buffers,
        as DDP does before each forward (``broadcast_buffers``): BatchNorm running statistics
        then are rank 0's, as under DDP, and the checkpoint holds the same values whichever
        process's copy it saves."""
        assert self.model is not None
        broadcast_buffers(self.model)
        return super().training_step(*args, **kwargs)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Load a sharded checkpoint into the sharded model and optimiser (re-split when the
        process count changed) and return its ``meta.pt`` (read with ``weights_only=True``).

        Lightning's loader asks the checkpoint for an optimiser state of every parameter; one
        that had none when saved (a layer frozen so far, e.g. DINO's last layer in epoch 0)
        fails there. Here such a parameter keeps no state, as in the uninterrupted run. State
        the method leaves out of its checkpoints (``unsaved_state_prefixes``, Distillation's
        frozen teacher) keeps the values it was rebuilt with.

        This strategy restores after ``setup`` and ``on_fit_start``, which already built the
        train loader (the method reads its length); the loader is dropped here, so the fit loop
        builds it again from the data module restored next, at the checkpoint's position.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:
            drop_combined_loader(trainer)
        if not is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        saved = set(read_metadata(path).state_dict_metadata)
        model_state = {"state_dict": get_model_state_dict(self.model)}
        prefixes = tuple(getattr(self.lightning_module, "unsaved_state_prefixes", ()))
        own = model_state["state_dict"]
        kept = {k: own.pop(k) for k in list(own)  # e.g. a frozen teacher rebuilt on load
                if prefixes and k.startswith(prefixes) and f"state_dict.{k}" not in saved}
        load_state(model_state, path)
        model_state["state_dict"].update(kept)
        self.model.load_state_dict(model_state["state_dict"],
                                   strict=self.lightning_module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = get_optimizer_state_dict(self.model, optimizer)
            states = cast(dict[str, dict[str, Any]], optimizer_state["state"])
            unsaved = {name for name, values in states.items()
                       if not all(f"{key}.state.{name}.{v}" in saved for v in values)}
            for name in unsaved:
                del states[name]
            state = {key: optimizer_state}
            load_state(state, path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key],
                                     options=StateDictOptions(strict=False))
            for name, parameter in self.model.named_parameters():
                if name in unsaved:
                    optimizer.state.pop(parameter, None)
        return torch.load(path / META_FILE, map_location="cpu", weights_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Write the checkpoint to ``<name>.tmp-<id>`` beside ``filepath`` and rename it there
        (the former checkpoint is removed only after the new one is complete)."""
        if not saves_distributed_checkpoint(self) or storage_options is not None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(os.fspath(filepath)))
        temporary = path.with_name(f"{path.name}.tmp-{self.broadcast(uuid.uuid4().hex)}")
        try:
            self._write_directory(checkpoint, temporary)
            self.barrier()
        except BaseException:
            if self.global_rank == 0:
                shutil.rmtree(temporary, ignore_errors=True)
            raise
        if self.global_rank == 0:
            old = path.with_name(f"{path.name}.old-{temporary.name.rsplit('-', 1)[1]}")
            if path.exists() or path.is_symlink():
                os.replace(path, old)
            os.replace(temporary, path)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            elif old.exists() or old.is_symlink():
                old.unlink()
        self.barrier()

    def _write_directory(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Lightning's distributed-checkpoint layout (``state_dict`` and ``optimizer_<i>`` in
        the shards, the rest in ``meta.pt``), with every tensor that all processes hold alike
        in name (unsharded buffers, byte items) written from global rank 0's copy, as a DDP
        checkpoint holds rank 0's (torch's default writes each from whichever process has
        written least, so BatchNorm running statistics came from any rank)."""
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{index}": optimizer_state for index, optimizer_state
                      in enumerate(checkpoint.pop("optimizer_states", []))})
        save(state, checkpoint_id=path, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        if self.global_rank == 0:
            torch.save(checkpoint, path / META_FILE)
