"""SSLMethod: the LightningModule every self-supervised method derives from.

A method owns an injected backbone, its heads and its loss, and the optimiser set-up. Subclasses
implement :meth:`SSLMethod.forward_views`, :meth:`SSLMethod.loss_from_outputs` and
:meth:`SSLMethod.build_criterion` (the loss module), and build their heads with
:meth:`SSLMethod.build_head` (a head given as a module replaces the default one); everything
shared (logging, the step output contract used by the evaluation callbacks, gathering across
ranks, LARS/SGD/AdamW with warm-up + cosine, the batch-size LR scaling rule, the cosine
weight-decay schedule, layer-wise lr decay for ViTs, micro-batching by gradient caching, the
per-batch reseeding of the model-side randomness) lives here; docs/optimisation_schedules.md
has the schedules' formulas and sources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from ssl_lightning._lightning import (
    attached_trainer,
    device_mesh,
    fit_train_dataloader,
    initial_hyperparameters,
    rank_zero_warn,
)
from ssl_lightning.backbones import backbone_spec, feature_dim
from ssl_lightning.backbones.multicrop import project_views_sample_major
from ssl_lightning.backbones.recorded import checkpoint_source, recorded_backbone
from ssl_lightning.compat.renamed import rename_hyperparameters
from ssl_lightning.data.preprocessing import PREPROCESSING_KEY, preprocessing_record
from ssl_lightning.distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    contiguous_grad,
    flatten_gathered,
    rank,
)
from ssl_lightning.distributed.sharding import require_sharded_strategy, shard_method, sharded_paths
from ssl_lightning.heads import build_mlp
from ssl_lightning.optim import (
    LRScaling,
    OptimizerName,
    build_optimizer,
    check_layer_decay,
    cosine_ramp,
    global_batch_size,
    layer_decay_multipliers,
    run_schedule,
    scale_lr,
    schedule_position,
    split_decay_groups,
)
from ssl_lightning.queues import FeatureQueue
from ssl_lightning.training.divergence import check_finite_loss, check_finite_weights
from ssl_lightning.training.grad_cache import (
    add_step_inputs,
    check_micro_batch_size,
    grad_cached_loss,
)
from ssl_lightning.training.sample_rng import keyed_forward
from ssl_lightning.training.step_rng import SeededSteps

#: A training batch: ``(views, targets)``, or ``(views, targets, sample_seeds)`` (data modules).
Batch = tuple[Sequence[Tensor], Tensor] | tuple[Sequence[Tensor], Tensor, Tensor]
#: Head arguments a method may take as modules (kept out of the saved hyperparameters, like the
#: backbone; their weights are in the state dict).
INJECTED_HEADS = ("projector", "predictor", "expander")


class _BuildsCriterion(type):
    """Metaclass of :class:`SSLMethod`: once the whole constructor chain has run (heads,
    teachers and every subclass's attributes are set), set ``criterion`` from
    :meth:`SSLMethod.build_criterion` unless a constructor set it (or the method has none)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        method = super().__call__(*args, **kwargs)
        if "criterion" not in method._modules:
            criterion = method.build_criterion()
            if criterion is not None:
                method.criterion = criterion
        return method


class SSLMethod(SeededSteps, metaclass=_BuildsCriterion):
    """Base class of all methods.

    Training batches are ``(views, targets)``: a list of view tensors (B, C, H, W) and integer
    targets (-1 when unlabeled). Validation batches are ``(images, targets)``; the step returns
    backbone features for the kNN / probe callbacks.

    Args:
        backbone: Any module mapping images (B, 3, H, W) to features (B, D).
        optimizer: ``"lars"``, ``"sgd"`` or ``"adamw"``.
        lr: Base learning rate, before the scaling rule.
        lr_scaling: ``"linear"``: lr × global_batch / 256; ``"sqrt"``: lr × sqrt(global_batch);
            ``"none"``: lr as given. global_batch = per-device batch × devices × nodes ×
            accumulate_grad_batches.
        weight_decay: Weight decay for weights; biases and norm parameters get none.
        weight_decay_end: Final weight decay of a cosine schedule from ``weight_decay`` (step 0)
            to this value (last step), set before every optimiser step from the global step
            (DINO, Caron et al. 2021: 0.04 → 0.4; I-JEPA's code likewise); None: constant.
        layer_decay: Layer-wise lr decay of a ViT backbone (BEiT, Bao et al. 2022; DINOv2:
            0.9): block ``i`` gets ``lr × layer_decay ** (depth − i)``, the patch embedding and
            tokens ``lr × layer_decay ** (depth + 1)``, the final norm and heads ``lr``. In
            (0, 1]; 1: off.
        patch_embed_lr_multiplier: Extra lr factor of the ViT patch embedding (DINOv2: 0.2).
        momentum: SGD/LARS momentum.
        betas: AdamW's (beta1, beta2); MAE uses (0.9, 0.95).
        lars_trust_coefficient: LARS eta (0.001 in the LARS paper and SimCLR; solo-learn's CIFAR
            recipes use 0.02 with their clipped variant).
        warmup_epochs: Linear warm-up length in epochs (fractions allowed), then cosine decay.
        final_lr_ratio: Learning rate at the end of the cosine as a fraction of the peak.
        image_size: Image side used to infer the backbone's feature size when it does not expose
            ``num_features``.
        channels_last: Store conv weights and backbone inputs in channels-last layout (faster
            convolutions on tensor-core GPUs, see README Performance).
        compile_backbone: ``torch.compile`` the (student) backbone in place when fitting starts.
        micro_batch_size: Run the networks on micro-batches of this many samples while the loss
            still sees the whole batch (gradient caching, Gao et al. 2021; exact large-batch
            gradients in the memory of a micro-batch, see docs/gradient_caching.md). Must divide
            the per-device batch size. ``None``: the whole batch at once.
        rng_seed: Seed of the model-side randomness. Masks and stochastic depth are drawn per
            sample from (this seed, the sample's seed) when the batch carries sample seeds
            (:mod:`~ssl_lightning.training.sample_rng`, docs/distributed.md); the rest (dropout,
            and everything for ``(views, targets)`` batches) from torch's generators reseeded
            before every training batch from (seed, epoch, batch index, rank)
            (:class:`~ssl_lightning.training.step_rng.SeededSteps`, docs/resume.md). ``None``:
            ``seed_everything``'s seed, else torch's initial seed. Saved in checkpoints; the
            saved seed wins on resume.
    """

    #: Smallest global batch (per-device batch x processes) the loss is meaningful for; a loss
    #: that compares each sample with the others of the batch needs 2 (checked at fit start).
    min_global_batch: int = 1
    #: Why :attr:`min_global_batch` is needed, for the error message.
    min_global_batch_reason: str = ""
    #: Views per sample the loss uses; None: all of them (multi-crop methods). A transform that
    #: makes more gets a warning: the extra views would be computed and silently ignored.
    views_used: int | None = 2
    #: The loss couples the samples of a batch (negatives, batch statistics, Sinkhorn, centre),
    #: so ``accumulate_grad_batches`` changes the objective (a warning says so).
    batch_coupled_loss: ClassVar[bool] = True
    #: State-dict prefixes a checkpoint leaves out because loading rebuilds them (a frozen
    #: teacher); the ``--ckpt_path`` check does not ask for them.
    unsaved_state_prefixes: ClassVar[tuple[str, ...]] = ()
    #: State-dict keys whose shape comes from the training data (sized when fit starts, or from
    #: the checkpoint on load: DeepCluster v2's dataset bank), not from the constructor; the
    #: ``--ckpt_path`` check does not compare their shapes.
    data_sized_state: ClassVar[tuple[str, ...]] = ()
    #: Deprecated constructor argument names of this class -> their new names (accepted with a
    #: warning for one release, see :mod:`ssl_lightning.compat.renamed`; never saved).
    renamed_arguments: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        backbone: nn.Module,
        optimizer: OptimizerName = "lars",
        lr: float = 0.3,
        lr_scaling: LRScaling = "linear",
        weight_decay: float = 1e-6,
        weight_decay_end: float | None = None,
        layer_decay: float = 1.0,
        patch_embed_lr_multiplier: float = 1.0,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        lars_trust_coefficient: float = 0.001,
        warmup_epochs: float = 10.0,
        final_lr_ratio: float = 0.0,
        image_size: int = 32,
        channels_last: bool = False,
        compile_backbone: bool = False,
        micro_batch_size: int | None = None,
        rng_seed: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(backbone, nn.Module):
            got = (f"the class {backbone.__name__} itself" if isinstance(backbone, type)
                   else f"{backbone!r} ({type(backbone).__name__})")
            raise TypeError(
                f"backbone must be an nn.Module instance, got {got}. Pass an instance, e.g. "
                "SmallConvNet() rather than SmallConvNet; in a config, backbone: {class_path: "
                "..., init_args: {...}}."
            )
        if micro_batch_size is not None:
            if micro_batch_size <= 0:
                raise ValueError(f"micro_batch_size must be > 0 or None, got {micro_batch_size}.")
            if type(self).training_loss is not SSLMethod.training_loss:
                raise ValueError(
                    f"micro_batch_size={micro_batch_size} needs {type(self).__name__} to implement "
                    "forward_views + loss_from_outputs instead of overriding training_loss."
                )
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}.")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
        if weight_decay_end is not None and weight_decay_end < 0:
            raise ValueError(f"weight_decay_end must be >= 0 or None, got {weight_decay_end}.")
        check_layer_decay(backbone, layer_decay, patch_embed_lr_multiplier)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {betas}.")
        if lars_trust_coefficient <= 0:
            raise ValueError(f"lars_trust_coefficient must be > 0, got {lars_trust_coefficient}.")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}.")
        if not 0 <= final_lr_ratio <= 1:
            raise ValueError(f"final_lr_ratio must be in [0, 1], got {final_lr_ratio}.")
        self.save_hyperparameters(ignore=["backbone", "teacher", *INJECTED_HEADS])
        rename_hyperparameters(self.hparams, type(self))
        rename_hyperparameters(initial_hyperparameters(self), type(self))  # for loggers
        self._step_targets: Tensor | None = None
        self._step_seeds: Tensor | None = None
        self.backbone = backbone
        self.feature_dim = feature_dim(backbone, image_size)
        self.image_size = int(image_size)
        self.weight_decay, self.weight_decay_end = weight_decay, weight_decay_end
        self.layer_decay, self.patch_embed_lr_multiplier = layer_decay, patch_embed_lr_multiplier
        self.optimizer_name, self.lr, self.lr_scaling = optimizer, lr, lr_scaling
        self.momentum, self.betas = momentum, betas
        self.lars_trust_coefficient = lars_trust_coefficient
        self.warmup_epochs, self.final_lr_ratio = warmup_epochs, final_lr_ratio
        self.channels_last, self.compile_backbone = channels_last, compile_backbone
        self.micro_batch_size = micro_batch_size
        self._views_checked = False
        self.register_load_state_dict_pre_hook(resize_data_sized_state)

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
        strict: bool | None = None, **kwargs: Any,
    ) -> Any:
        """Lightning's ``load_from_checkpoint``; without ``backbone=...`` the backbone is
        rebuilt from the checkpoint's recorded spec (:mod:`ssl_lightning.backbones.recorded`), so
        ``DINO.load_from_checkpoint("last.ckpt")`` works for every checkpoint a run writes (a
        sharded checkpoint directory included)."""
        if "backbone" not in kwargs:
            kwargs["backbone"] = recorded_backbone(checkpoint_path, cls.__name__)
        return super().load_from_checkpoint(checkpoint_source(checkpoint_path), map_location,
                                            hparams_file, strict, **kwargs)

    # ----------------------------------------------------------------- to implement / override
    def build_criterion(self) -> nn.Module | None:
        """The loss module, from the method's hyperparameters. The base class sets
        ``self.criterion`` from it after the whole constructor chain has run (so it may read
        what any ``__init__`` set); a subclass changes the loss by overriding this hook alone.
        None (the default): the method has no loss module."""
        return None

    def training_loss(self, views: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Return ``(loss, features)``: the scalar loss of this rank and the backbone features
        of the first view (used, detached, by the evaluation callbacks).

        The default splits the step in two (what gradient caching needs): the networks
        (:meth:`forward_views`) and the loss on their outputs (:meth:`loss_from_outputs`). The
        training batch's targets (B,) (-1: unlabelled) join the outputs as ``"targets"``, and
        its sample seeds (B,), when the batch carries them, as ``"sample_seeds"``, per sample
        like every output, for the methods that use labels (SupCon) or dataset indices
        (DeepCluster v2, :func:`~ssl_lightning.data.seeding.sample_indices`).
        """
        outputs = self.forward_views(views)
        add_step_inputs(self, outputs)
        return self.loss_from_outputs(outputs), outputs["features"]

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """The networks only: per-sample outputs the loss needs (every leaf tensor or list of
        tensors has the batch in dim 0; teacher outputs computed under ``no_grad``), and
        ``"features"``: the backbone features of the first view. No gathers, no state updates."""
        raise NotImplementedError

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        """The loss of this rank from :meth:`forward_views`'s outputs for the whole batch:
        gathers across ranks, queue / centre updates happen here."""
        raise NotImplementedError

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """``(student, teacher)`` module pairs the EMA callback updates; none by default."""
        return []

    def trainable_modules(self) -> list[nn.Module]:
        """Modules whose parameters the optimiser updates (all but the EMA teachers)."""
        teachers = {id(t) for _, t in self.ema_pairs()}
        return [m for m in self.children() if id(m) not in teachers]

    # ------------------------------------------------------------------------- shared helpers
    def build_head(
        self, name: str, injected: nn.Module | None, default: Callable[[], nn.Module],
        in_dim: int, out_dim: int, out_argument: str,
    ) -> nn.Module:
        """The head ``name``: ``injected`` (a module given as an argument, e.g. a config's
        ``projector: {class_path: ..., init_args: ...}``) when set, else ``default()``.

        Raises:
            TypeError: ``injected`` is not an ``nn.Module`` instance.
            ValueError: ``injected`` does not map (B, ``in_dim``) inputs to (B, ``out_dim``),
                naming the argument (``out_argument``) that sets the width the method expects.
        """
        if injected is None:
            return default()
        method = type(self).__name__
        if not isinstance(injected, nn.Module):
            raise TypeError(f"{method} {name} must be an nn.Module instance, got "
                            f"{type(injected).__name__}; in a config, {name}: {{class_path: "
                            "..., init_args: {...}}.")
        was_training = injected.training
        injected.eval()
        try:
            with torch.no_grad():
                shape = tuple(injected(torch.zeros(2, in_dim)).shape)
        except RuntimeError as error:
            raise ValueError(f"{method} {name} {type(injected).__name__} does not run on "
                             f"(batch, {in_dim}) inputs: {error}") from error
        finally:
            injected.train(was_training)
        if shape != (2, out_dim):
            raise ValueError(
                f"{method} {name} {type(injected).__name__} maps (batch, {in_dim}) to {shape[1:]}"
                f", but {method} expects ({out_dim},) ({out_argument}={out_dim}); set "
                f"{out_argument} to its output size or change the {name}."
            )
        return injected

    def build_mlp_projector(self, injected: nn.Module | None, hidden_dim: int, out_dim: int,
                            layers: int, batch_norm: bool, **mlp_options: Any) -> nn.Module:
        """The ``projector`` head: ``injected`` when set (checked by :meth:`build_head`), else
        :func:`~ssl_lightning.heads.build_mlp` from the backbone features to ``out_dim``
        (``projection_dim``); ``mlp_options`` go to ``build_mlp`` (e.g. ``last_bias``)."""
        return self.build_head("projector", injected, lambda: build_mlp(
            self.feature_dim, hidden_dim, out_dim, layers, batch_norm=batch_norm, **mlp_options,
        ), self.feature_dim, out_dim, "projection_dim")

    def forward(self, x: Tensor) -> Tensor:
        """Backbone features."""
        return self.backbone(x)

    def gather(self, x: Tensor) -> Tensor:
        """Concatenate ``x`` over all ranks, keeping gradients (identity on one process).

        Goes through Lightning when a trainer is attached, else through the default process
        group (so a method can be used in a user's own loop and in loss-level DDP tests).
        """
        if attached_trainer(self) is None:
            return all_gather_with_grad(x)
        return contiguous_grad(flatten_gathered(cast(Tensor, self.all_gather(x, sync_grads=True)),
                                                x))

    def gather_no_grad(self, x: Tensor) -> Tensor:
        """Concatenate ``x`` over all ranks (rank-major) outside autograd (keys, queues)."""
        if attached_trainer(self) is None:
            return all_gather_no_grad(x)
        with torch.no_grad():
            return flatten_gathered(cast(Tensor, self.all_gather(x)), x)

    def rank_offset(self, local_batch: int) -> int:
        """Index of this rank's first sample in a gathered batch (equal batches on all ranks)."""
        return (self.global_rank if attached_trainer(self) is not None else rank()) * local_batch

    def project_views(self, views: Sequence[Tensor], min_views: int = 2) -> dict[str, Any]:
        """``{"z": (B, V, D), "features": (B, F)}``: :attr:`projector` on every view's backbone
        features, sample-major (:func:`project_views_sample_major`), for methods whose loss
        compares the V views of each sample; ``ValueError`` under ``min_views`` views."""
        self.require_views(views, min_views)
        z, features = project_views_sample_major(self.backbone, self.projector, views)
        return {"z": z, "features": features}

    def log_terms(self, prefix: str, terms: Iterable[tuple[str, Tensor]], batch_size: int) -> None:
        """Log each ``(name, value)`` of the loss as ``train/{prefix}_{name}``, averaged over the
        epoch and the ranks (nothing when no trainer is attached: a user's own loop)."""
        if attached_trainer(self) is None:
            return
        for name, value in terms:
            self.log(f"train/{prefix}_{name}", value, on_step=False, on_epoch=True,
                     sync_dist=True, batch_size=batch_size)

    # ------------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        """Apply ``channels_last`` / ``compile_backbone`` once, after subclasses built their
        heads and teachers (compiling before a teacher is deep-copied would share the graph)."""
        if getattr(self, "_layout_applied", False):
            return
        self._layout_applied = True
        if self.channels_last:
            self.to(memory_format=torch.channels_last)
            self.backbone.register_forward_pre_hook(_inputs_to_channels_last)
        if self.compile_backbone:
            self.backbone.compile()

    def configure_model(self) -> None:
        """Under ``ShardedStrategy`` (``configs/shared/fsdp.yaml``): shard the backbone, heads
        and teachers with FSDP2, once (:func:`ssl_lightning.distributed.sharding.shard_method`; the
        strategy's ``activation_checkpointing`` and ``mixed_precision``). Lightning's own
        ``ModelParallelStrategy`` is refused (:func:`ssl_lightning.distributed.sharding.
        require_sharded_strategy`)."""
        if device_mesh(self) is None or sharded_paths(self.backbone):
            return
        strategy = self.trainer.strategy
        require_sharded_strategy(strategy)
        shard_method(self, device_mesh(self),
                     activation_checkpointing=getattr(strategy, "activation_checkpointing", False),
                     mixed_precision=getattr(strategy, "mixed_precision", False))

    def on_fit_start(self) -> None:
        self.check_global_batch()

    def check_global_batch(self) -> None:
        """Before the first step: refuse a global batch below :attr:`min_global_batch`, and a
        queue (MoCo's negatives, NNCLR's support set, NT-Xent's memory bank) whose size is not
        a multiple of the global batch it receives every step.

        Raises:
            ValueError: naming the per-device batch, the process count and what to change.
        """
        batch_size = getattr(fit_train_dataloader(self.trainer), "batch_size", None)
        if not isinstance(batch_size, int):
            return
        world = self.trainer.world_size
        layout = f"batch_size={batch_size} x {world} process(es)"
        if batch_size * world < self.min_global_batch:
            raise ValueError(
                f"{type(self).__name__} needs a global batch (batch_size x processes) of >= "
                f"{self.min_global_batch}, got {layout}: {self.min_global_batch_reason}. "
                "Raise --data.batch_size."
            )
        global_batch = batch_size * world
        for name, queue in self.named_modules():
            if isinstance(queue, FeatureQueue) and queue.size % global_batch:
                fits = max(1, queue.size // global_batch) * global_batch
                raise ValueError(
                    f"{type(self).__name__}.{name} holds {queue.size} embeddings, not a multiple "
                    f"of the global batch {global_batch} ({layout}) that it receives every "
                    f"step. Use queue_size {fits} or {fits + global_batch}, or a batch size "
                    f"that divides {queue.size}."
                )

    def require_views(self, views: Sequence[Tensor], count: int = 2) -> None:
        """``ValueError`` naming the method when a sample has fewer than ``count`` views."""
        if len(views) < count:
            raise ValueError(
                f"{type(self).__name__} needs {count} views per sample, got {len(views)}.")

    def warn_unused_views(self, views: Sequence[Tensor]) -> None:
        """Warn once when the batch has more views than the loss uses (:attr:`views_used`)."""
        if self._views_checked:
            return
        self._views_checked = True
        if self.views_used is not None and len(views) > self.views_used:
            rank_zero_warn(
                f"{type(self).__name__} uses {self.views_used} views per sample, but the train "
                f"transform makes {len(views)}: the other {len(views) - self.views_used} (e.g. "
                "the local crops of MultiCropViews) are computed and ignored. Use a "
                f"{self.views_used}-view transform (SimCLRViews, BYOLViews) or a multi-crop "
                "method (DINO, SwAV)."
            )

    def on_train_start(self) -> None:
        """Before the first step: ``micro_batch_size`` must divide the loader's batch size;
        warn when gradient accumulation changes a batch-coupled objective."""
        micro = self.micro_batch_size
        batch_size = getattr(self.trainer.train_dataloader, "batch_size", None)
        if micro is not None and isinstance(batch_size, int):
            check_micro_batch_size(micro, batch_size)
        accumulate = self.trainer.accumulate_grad_batches
        if accumulate > 1 and self.batch_coupled_loss:
            rank_zero_warn(
                f"accumulate_grad_batches={accumulate} with {type(self).__name__}, whose loss "
                f"couples the samples of a batch: each of the {accumulate} accumulated batches "
                f"has its own loss (1/{accumulate} of the negatives / batch statistics), which is "
                "not the large-batch objective. For the exact loss of a larger batch in the same "
                "memory, raise the batch size and set micro_batch_size (gradient caching, "
                "docs/gradient_caching.md)."
            )

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, Tensor]:
        """The step on ``(views, targets)`` or ``(views, targets, sample_seeds)``: with the
        seeds (the data modules' batches) the networks run inside a keyed forward, so masks
        and stochastic depth are drawn per sample (:mod:`~ssl_lightning.training.sample_rng`);
        without them from torch's generator reseeded per (seed, epoch, batch, rank)."""
        views, targets, *seeds = batch
        self.warn_unused_views(views)
        keys = self.sample_keys(seeds[0], batch_idx) if seeds else None
        self._step_targets = targets  # read by training_loss / loss_from_outputs; this step only
        self._step_seeds = seeds[0] if seeds else None
        try:
            micro = self.micro_batch_size
            if micro is not None and micro < len(targets):
                loss, features = grad_cached_loss(self, views, micro, self._loss_scale(), keys)
            else:
                with keyed_forward(keys):
                    loss, features = self.training_loss(views)
        finally:
            self._step_targets = self._step_seeds = None
        check_finite_loss(self, loss, batch_idx)  # every rank stops here together on NaN/inf
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True,
                 batch_size=len(targets))
        return {"loss": loss, "features": features.detach(), "targets": targets}

    def _loss_scale(self) -> Tensor | float:
        """The factor Lightning's backward applies to the training_step loss: the GradScaler
        scale (16-mixed) over ``accumulate_grad_batches``."""
        if attached_trainer(self) is None:
            return 1.0
        scale: Tensor | float = 1.0
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale = scaler.scale(torch.ones((), device=self.device))
        return scale / self.trainer.accumulate_grad_batches

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        return {"features": self.backbone(images), "targets": targets}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop (on every rank) when the update just made left non-finite weights."""
        check_finite_weights(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse to write non-finite weights over the last good checkpoint (DDP: every rank
        holds the same weights, so the local check raises on all ranks together), and record
        the backbone's class and arguments, so evaluation, ``embed`` and ``export`` rebuild it
        from the checkpoint alone, how the backbone was fed (the data module's evaluation
        transform, :mod:`ssl_lightning.data.preprocessing`), and the :attr:`rng_seed`."""
        check_finite_weights(self, reduce=False)
        spec = backbone_spec(self.backbone)
        if spec is not None:
            checkpoint["backbone_spec"] = spec
        trainer = attached_trainer(self)
        record = preprocessing_record(getattr(trainer, "datamodule", None))
        if record is not None:
            checkpoint[PREPROCESSING_KEY] = record
        super().on_save_checkpoint(checkpoint)  # the rng_seed

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        fit_train_dataloader(self.trainer)  # max_steps without max_epochs: not loaded yet
        global_batch = global_batch_size(self.trainer, self.lr_scaling)
        lr = scale_lr(self.lr, global_batch, self.lr_scaling)
        groups = self.param_groups()
        optimizer = build_optimizer(
            self.optimizer_name, groups, lr=lr, momentum=self.momentum,
            betas=(self.betas[0], self.betas[1]), trust_coefficient=self.lars_trust_coefficient,
        )
        scheduler = run_schedule(self.trainer, optimizer, self.warmup_epochs,
                                 self.final_lr_ratio, global_batch)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def param_groups(self) -> list[dict]:
        """Optimiser parameter groups (weights with decay; biases and norms without). A group
        with ``"fixed_lr": True`` keeps the scaled peak lr throughout (no warm-up, no cosine)."""
        return self.decay_groups(self.trainable_modules())

    def decay_groups(self, modules: Sequence[nn.Module]) -> list[dict]:
        """:func:`split_decay_groups` of ``modules`` with this method's weight decay, split
        further by the backbone's layer-wise lr multipliers when ``layer_decay`` or
        ``patch_embed_lr_multiplier`` is set."""
        multipliers = None
        if self.layer_decay != 1 or self.patch_embed_lr_multiplier != 1:
            multipliers = layer_decay_multipliers(self.backbone, self.layer_decay,
                                                  self.patch_embed_lr_multiplier)
        return split_decay_groups(modules, self.weight_decay, multipliers)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The cosine weight-decay schedule (``weight_decay_end``): the decay groups'
        (``weight_decay_schedule``) value for this step, a pure function of the global step, so
        a resumed run uses the values of an uninterrupted one."""
        end = self.weight_decay_end
        if end is None:
            return
        wd = cosine_ramp(*schedule_position(self.trainer, self.trainer.global_step),
                             self.weight_decay, end)
        for group in optimizer.param_groups:
            if group.get("weight_decay_schedule"):
                group["weight_decay"] = wd


def _inputs_to_channels_last(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: 4-D image inputs in channels-last layout."""
    x, *rest = args
    if isinstance(x, Tensor) and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return (x, *rest)


def resize_data_sized_state(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                            *args: Any) -> None:
    """``load_state_dict`` pre-hook: give every :attr:`SSLMethod.data_sized_state` buffer the
    shape of the state it loads (a model built before it saw its data: a resume, or Lightning's
    ``ddp_spawn`` launcher loading the trained state back into the main process)."""
    for key in getattr(module, "data_sized_state", ()):
        incoming = state_dict.get(prefix + key)
        owner_path, _, name = key.rpartition(".")
        owner = module.get_submodule(owner_path)
        current = getattr(owner, name)
        if isinstance(incoming, Tensor) and incoming.shape != current.shape:
            setattr(owner, name, torch.zeros(incoming.shape, dtype=current.dtype,
                                             device=current.device))
