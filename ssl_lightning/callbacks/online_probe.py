"""Online linear probe: a linear classifier trained on the detached backbone features.

The standard SSL monitor (e.g. solo-learn's online classifier, the BYOL/SimCLR "online linear
evaluation"; Chen et al., ICML 2020, §B.9 use a probe on stop-gradient features): it costs one
``Linear`` forward/backward per step, never changes the backbone, and tracks how linearly
separable the representation is while pre-training runs. A grid of learning rates × weight
decays (``lrs``, ``weight_decays``) and feature sources (``last_blocks`` × ``poolings``) trains
one head per combination on the same features, each exactly as if alone (DINOv2's
``eval/linear.py`` grid; see :mod:`ssl_lightning.callbacks.probe_grid`). The ``tokens`` source
trains attentive heads (the cross-attention pooling of the offline
:class:`~ssl_lightning.evaluation.AttentiveEval`) on the frozen patch tokens, in the same grid.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning._lightning import pl, rank_zero_warn
from ssl_lightning.callbacks.knn import gather_variable, padding_mask, val_sampler
from ssl_lightning.callbacks.probe_grid import (
    AttentiveHeads,
    LinearHeads,
    Source,
    check_sources,
    format_grid,
    head_param_groups,
    probe_grid,
    source_dims,
    source_features,
)
from ssl_lightning.distributed import all_reduce_mean_no_grad, all_reduce_sum_no_grad, world_size
from ssl_lightning.optim import build_optimizer


class OnlineProbe(pl.Callback):
    """Trains ``Linear(feature_dim, num_classes)`` on ``training_step``'s detached features (a
    grid of linear heads, and attentive heads on a ViT's patch tokens, below).

    Every training batch, the features and targets returned by ``training_step``
    (``outputs["features"]``, ``outputs["targets"]``) are gathered from all ranks, samples with
    target -1 (unlabeled) are dropped, and the probe takes one SGD step on the cross-entropy of
    the whole global batch. Every rank therefore makes the identical update and the probe
    weights (zero-initialised on every rank) stay the same everywhere without a DDP wrapper.
    ``train/probe_acc`` is the accuracy on each global batch before the update;
    ``val/probe_top1`` (percent) is measured on the validation dataloader
    ``val_dataloader_idx`` (the labeled val split), with the
    ``DistributedSampler`` padding duplicates dropped. The probe weights and its optimiser
    state are saved in the checkpoint (``state_dict``) and restored on resume.

    With several ``lrs`` / ``weight_decays``, one zero-initialised head per pair trains on the
    same gathered features with its own SGD parameter group (so exactly as if it were alone);
    ``train/probe_loss`` is the mean of their losses; each validation logs every head's top-1
    as ``val/probe_grid_top1/<head name>`` and ``val/probe_top1`` is the best head's (the first
    on ties), as is ``train/probe_acc``; the end of fit prints the table of all heads.

    Feature sources (``last_blocks`` × ``poolings``, :mod:`~ssl_lightning.callbacks.probe_grid`):
    with the default ``poolings=["pooled"]`` the heads read ``training_step``'s features and
    nothing is computed twice. Token sources (``cls``, ``mean``, ``cls+mean`` of the last ``n``
    blocks; a ViT backbone, checked in ``setup``) come from one extra no-grad forward of
    ``pl_module.backbone`` per batch, in eval mode (no dropout or stochastic depth, no BatchNorm
    statistics updated, no random numbers drawn, so the training and its resume are unchanged),
    on the **first view of the training batch as the method sees it**: the batch after
    ``on_after_batch_transfer``, so views made on the device (``DeviceViews``) are the ones
    read. That is the image whose features the ``pooled`` heads already read, so every source
    of the grid sees the same images; the data modules have no un-augmented copy of the
    training images to read instead (the validation split is the un-augmented one). A
    ``pooled`` head in a grid with token sources still reads ``training_step``'s features.
    At validation the sources come from the val images (the eval transform).

    Attentive heads (``poolings`` with ``tokens``): one
    :class:`~ssl_lightning.heads.AttentivePooling` + ``nn.Linear`` per (last blocks, lr, weight
    decay), AttentiveEval's head, on the final-norm patch tokens of the last ``n`` blocks
    (concatenated along the channels) from the same extra forward. Their weights decay, their
    biases and LayerNorms do not (as AttentiveEval's); each starts from a seed of its own (the
    same alone or in any grid, and on every rank; the run's random numbers are not drawn). The
    tokens are not gathered: each rank runs the heads on its own samples and the gradients are
    summed over ranks (divided by the global number of labeled samples), so the update is the
    one of the whole global batch, as on one process.

    Args:
        num_classes: Number of classes; read from ``trainer.datamodule.num_classes`` when None
            (the probe disables itself with a warning when neither knows it: unlabeled data).
        feature_dim: Input size; read from ``pl_module.feature_dim`` when None.
        lr: Learning rate of the probe's optimiser.
        momentum: SGD momentum.
        weight_decay: Weight decay.
        val_dataloader_idx: Validation dataloader whose accuracy is logged as ``val/probe_top1``.
        lrs: Learning rates of a grid of heads (``[lr]`` when None).
        weight_decays: Weight decays of the grid (``[weight_decay]`` when None).
        last_blocks: Numbers of last blocks whose tokens are concatenated (``[1]``).
        poolings: Feature sources: ``pooled`` (``training_step``'s features), ``cls``,
            ``mean`` or ``cls+mean`` (linear heads), ``tokens`` (attentive heads)
            (``["pooled"]``).
        optimizer: ``sgd`` (with ``momentum``) or ``adamw`` (V-JEPA's and AttentiveEval's, for
            attentive heads), for every head of the grid.
        attentive_num_heads: Attention heads of the attentive pooling.
        attentive_num_queries: Learned queries of the attentive pooling.
        attentive_mlp_ratio: V-JEPA's MLP block of the attentive pooling (None: AIM's head).
    """

    def __init__(
        self,
        num_classes: int | None = None,
        feature_dim: int | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        val_dataloader_idx: int = 1,
        lrs: list[float] | None = None,
        weight_decays: list[float] | None = None,
        last_blocks: list[int] | None = None,
        poolings: list[str] | None = None,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        attentive_num_heads: int = 1,
        attentive_num_queries: int = 1,
        attentive_mlp_ratio: float | None = 4.0,
    ) -> None:
        super().__init__()
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"OnlineProbe num_classes must be >= 2, got {num_classes}.")
        if feature_dim is not None and feature_dim < 1:
            raise ValueError(f"OnlineProbe feature_dim must be >= 1, got {feature_dim}.")
        if not lr > 0:
            raise ValueError(f"OnlineProbe lr must be > 0, got {lr}.")
        if not 0 <= momentum < 1:
            raise ValueError(f"OnlineProbe momentum must be in [0, 1), got {momentum}.")
        if weight_decay < 0:
            raise ValueError(f"OnlineProbe weight_decay must be >= 0, got {weight_decay}.")
        self.num_classes, self.feature_dim = num_classes, feature_dim
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.val_dataloader_idx = val_dataloader_idx
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"OnlineProbe optimizer must be 'sgd' or 'adamw', got {optimizer!r}.")
        self.specs = probe_grid(lrs or [lr], weight_decays or [weight_decay],
                                last_blocks or [1], poolings or ["pooled"])
        self.optimizer_name = optimizer
        self.attentive_options = (attentive_num_heads, attentive_num_queries, attentive_mlp_ratio)
        #: Positions in ``specs`` of the linear heads and of the attentive (``tokens``) heads.
        self.linear_index = [i for i, s in enumerate(self.specs) if s.pooling != "tokens"]
        self.attentive_index = [i for i, s in enumerate(self.specs) if s.pooling == "tokens"]
        self.sources: list[Source] = list(dict.fromkeys(s.source for s in self.specs))
        #: The token sources, computed by the probe's own forward (empty: none needed).
        self.token_sources = [s for s in self.sources if s[1] != "pooled"]
        self.best_head = 0
        self._grid_top1: list[float] | None = None
        self.linear: LinearHeads | None = None
        self.attentive: AttentiveHeads | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending_state: dict[str, Any] | None = None
        self._val_hits: list[Tensor] = []

    # ------------------------------------------------------------------------ building / state
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.optimizer is not None:
            return
        datamodule = getattr(trainer, "datamodule", None)
        num_classes = self.num_classes or getattr(datamodule, "num_classes", None)
        feature_dim = self.feature_dim or getattr(pl_module, "feature_dim", None)
        if not isinstance(feature_dim, int):
            raise ValueError(
                "OnlineProbe needs feature_dim (or a module with a feature_dim attribute); got "
                f"{feature_dim}."
            )
        if not isinstance(num_classes, int):
            rank_zero_warn(
                "OnlineProbe is disabled: no num_classes given and the datamodule does not know "
                "it (unlabeled data without a labeled val split)."
            )
            return
        dims: dict[Source, int] = {(1, "pooled"): feature_dim}
        if self.token_sources:
            backbone = getattr(pl_module, "backbone", None)
            if not isinstance(backbone, torch.nn.Module):
                raise ValueError(
                    f"OnlineProbe poolings {sorted({p for _, p in self.token_sources})} read the "
                    f"backbone's tokens, but {type(pl_module).__name__} has no backbone "
                    "attribute: use poolings [pooled].")
            check_sources(backbone, self.token_sources)
            dims.update(source_dims(backbone, self.token_sources))
        # Built without drawing the run's random numbers (nn.Linear's default init draws some,
        # as many as the grid has weights): the method trains the same with any grid.
        with torch.random.fork_rng(devices=[]):
            self.optimizer = self._build(dims, num_classes)

    def _build(self, dims: dict[Source, int], num_classes: int) -> torch.optim.Optimizer:
        """The heads of the grid and their optimiser."""
        groups: list[dict] = []
        if self.linear_index:
            # Zero init: deterministic and identical on every rank without a broadcast (the
            # problem is convex, so nothing is lost against a random init).
            specs = [self.specs[i] for i in self.linear_index]
            self.linear = LinearHeads(specs, dims, num_classes, init_std=0.0)
            groups += [{"params": list(head.parameters()), "lr": spec.lr,  # decay on the bias
                        "weight_decay": spec.weight_decay}  # too, as before the grid
                       for spec, head in zip(specs, self.linear.heads, strict=True)]
        if self.attentive_index:
            specs = [self.specs[i] for i in self.attentive_index]
            # Seeded per head: the same alone, in any grid and on every rank.
            self.attentive = AttentiveHeads(specs, dims, num_classes, *self.attentive_options,
                                            seeded=True)
            groups += head_param_groups(specs, list(self.attentive.heads), 1.0)
        return build_optimizer(self.optimizer_name, groups, lr=self.lr, momentum=self.momentum)

    def _parts(self) -> list[torch.nn.Module]:
        """The head modules: the linear heads, the attentive heads (those the grid has)."""
        return [part for part in (self.linear, self.attentive) if part is not None]

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        if self._pending_state is not None:  # restored but not used yet
            return self._pending_state
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(),
                                 "best_head": self.best_head}
        if self.linear is not None:
            state["linear"] = self.linear.state_dict()
        if self.attentive is not None:
            state["attentive"] = self.attentive.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied once the probe sits on the module's device, so that the optimiser state is
        # cast to that device (Lightning restores callbacks before moving the model).
        self._pending_state = state_dict or None

    def _ready(self, pl_module: pl.LightningModule) -> torch.dtype:
        """Heads on the module's device, in float64 when the module trains in float64
        (exactness tests), else float32, with a restored state applied; their dtype."""
        if self.optimizer is None:
            raise RuntimeError("OnlineProbe used before setup().")
        dtype = torch.float64 if pl_module.dtype == torch.float64 else torch.float32
        for part in self._parts():
            weight = next(part.parameters())
            if weight.device != pl_module.device or weight.dtype != dtype:
                part.to(pl_module.device, dtype)
        if self._pending_state is not None:
            state = self._pending_state
            if self.linear is not None:
                linear = state["linear"]
                if "weight" in linear:  # a checkpoint from before the grid: its one nn.Linear
                    linear = {f"heads.0.{key}": value for key, value in linear.items()}
                self.linear.load_state_dict(linear)
            if self.attentive is not None:
                self.attentive.load_state_dict(state["attentive"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.best_head = int(state.get("best_head", 0))
            self._pending_state = None
        return dtype

    # ------------------------------------------------------------------------------- training
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        if self.optimizer is None:
            return
        dtype = self._ready(pl_module)
        local = self._features(pl_module, outputs["features"], _first_view(batch))
        local_targets = outputs["targets"].detach().to(pl_module.device)
        # One collective for the linear heads' sources: targets ride along as an extra (exact)
        # float column. The attentive heads' tokens stay on their rank.
        sources = self.linear.sources if self.linear is not None else []
        widths = [local[source].shape[1] for source in sources]
        packed = gather_variable(torch.cat(
            [*(local[source].to(dtype) for source in sources),
             local_targets.to(dtype).unsqueeze(1)], dim=1))
        features = dict(zip(sources, packed[:, :-1].split(widths, dim=1), strict=True))
        targets = packed[:, -1].long()
        labeled = targets >= 0
        count = int(labeled.sum())  # the global batch's labeled samples, the same on every rank
        if count == 0:
            return
        targets = targets[labeled]
        losses = torch.zeros(len(self.specs), dtype=dtype, device=targets.device)
        hits = torch.zeros((), dtype=dtype, device=targets.device)  # the best head's
        with torch.enable_grad(), torch.autocast(targets.device.type, enabled=False):
            self.optimizer.zero_grad(set_to_none=True)
            total = losses.new_zeros(())
            if self.linear is not None:
                logits = self.linear({s: value[labeled] for s, value in features.items()})
                linear_losses = torch.stack([F.cross_entropy(head, targets) for head in logits])
                # The sum: each head gets the gradient of its own loss (as if trained alone).
                total = total + linear_losses.sum()
                losses[self.linear_index] = linear_losses.detach()
                if self.best_head in self.linear_index:
                    best = logits[self.linear_index.index(self.best_head)].detach()
                    hits = (best.argmax(dim=1) == targets).sum().to(dtype)
            local_hits: Tensor | None = None
            if self.attentive is not None:
                shares, local_hits = self._attentive_losses(local, local_targets, count, losses)
                total = total + shares
            total.backward()
            if self.attentive is not None:  # each rank's share of the global gradient: summed
                hits = self._sum_over_ranks(losses, hits, local_hits)
            self.optimizer.step()
        pl_module.log("train/probe_acc", hits / count, on_step=True, on_epoch=True,
                      sync_dist=True, batch_size=count)
        pl_module.log("train/probe_loss", losses.sum() / len(losses), on_step=True,
                      on_epoch=True, sync_dist=True, batch_size=count)

    def _attentive_losses(self, local: dict[Source, Tensor], targets: Tensor, count: int,
                          losses: Tensor) -> tuple[Tensor, Tensor | None]:
        """The attentive heads' losses on this rank's labeled samples, each summed and divided
        by the global labeled ``count`` (summed over ranks, the global batch's mean), written
        into ``losses``; returns their sum (to differentiate) and, when the best head is
        attentive, its hits on this rank."""
        attentive = cast(AttentiveHeads, self.attentive)
        labeled = targets >= 0
        kept = targets[labeled]
        logits = attentive({source: local[source][labeled].to(losses.dtype)
                            for source in attentive.sources})  # (attentive heads, b, classes)
        shares = torch.stack([F.cross_entropy(head, kept, reduction="sum") / count
                              for head in logits])
        losses[self.attentive_index] = shares.detach()
        if self.best_head not in self.attentive_index:
            return shares.sum(), None
        best = logits[self.attentive_index.index(self.best_head)].detach()
        return shares.sum(), (best.argmax(dim=1) == kept).sum().to(losses.dtype)

    def _sum_over_ranks(self, losses: Tensor, hits: Tensor, local_hits: Tensor | None) -> Tensor:
        """Sum the attentive heads' gradients, loss shares and (``local_hits``: the best head is
        one of them) hits over ranks in one collective; returns the best head's global hits."""
        params = list(cast(AttentiveHeads, self.attentive).parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        extra = hits.new_zeros(1) if local_hits is None else local_hits[None]
        flat = all_reduce_sum_no_grad(torch.cat(
            [*(g.flatten() for g in grads), losses[self.attentive_index], extra]))
        parts = flat.split([*(g.numel() for g in grads), len(self.attentive_index), 1])
        for p, g in zip(params, parts[:len(params)], strict=True):
            p.grad = g.view_as(p).clone()
        losses[self.attentive_index] = parts[-2]
        return hits if local_hits is None else parts[-1][0]

    def _features(self, pl_module: pl.LightningModule, pooled: Tensor, images: Tensor
                  ) -> dict[Source, Tensor]:
        """Every source's (B, D) features: ``pooled`` from the step's output, the token sources
        from one no-grad eval-mode forward of the backbone on ``images``."""
        features: dict[Source, Tensor] = {(1, "pooled"): pooled.detach()}
        if self.token_sources:
            backbone = cast(torch.nn.Module, pl_module.backbone)
            with torch.no_grad(), _eval_mode(backbone), \
                    pl_module.trainer.precision_plugin.forward_context():
                features.update(source_features(backbone, images, self.token_sources))
        return features

    # ----------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_hits.clear()

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:
        if dataloader_idx != self.val_dataloader_idx or self.optimizer is None:
            return
        dtype = self._ready(pl_module)
        features = self._features(pl_module, outputs["features"], batch[0])
        with torch.no_grad(), torch.autocast(pl_module.device.type, enabled=False):
            predictions = self._logits({source: value.to(dtype)
                                        for source, value in features.items()}).argmax(2)
        targets = outputs["targets"].to(predictions.device)
        # Per sample and head: correct/incorrect; unlabeled samples are -1, skipped at epoch end.
        self._val_hits.append(torch.where(targets >= 0, (predictions == targets).long(), -1).T)

    def _logits(self, features: dict[Source, Tensor]) -> Tensor:
        """Every head's logits (heads, B, classes), in the order of ``specs``."""
        logits: list[Tensor] = [torch.empty(0)] * len(self.specs)
        for part, index in ((self.linear, self.linear_index),
                            (self.attentive, self.attentive_index)):
            if part is not None:
                for i, head_logits in zip(index, part(features), strict=True):
                    logits[i] = head_logits
        return torch.stack(logits)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._val_hits:
            return
        hits = torch.cat(self._val_hits)
        self._val_hits.clear()
        hits = hits[padding_mask(len(hits), val_sampler(trainer, self.val_dataloader_idx),
                                 hits.device)]
        counts = torch.cat([(hits == 1).sum(dim=0), (hits[:, 0] >= 0).sum()[None]]).double()
        counts = all_reduce_mean_no_grad(counts) * world_size()
        if counts[-1] == 0:
            return
        top1 = [float(100 * hit / counts[-1]) for hit in counts[:-1]]
        self.best_head = max(range(len(top1)), key=lambda i: (top1[i], -i))
        self._grid_top1 = top1
        if len(top1) > 1:
            for spec, value in zip(self.specs, top1, strict=True):
                pl_module.log(f"val/probe_grid_top1/{spec.name}", value, sync_dist=True)
        pl_module.log("val/probe_top1", top1[self.best_head], sync_dist=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print every head's last val top-1 and the chosen one (a grid of several heads)."""
        if self._grid_top1 is None or len(self.specs) < 2 or not trainer.is_global_zero:
            return
        table = format_grid([s.name for s in self.specs], self._grid_top1, self.best_head)
        print(f"OnlineProbe grid ({len(self.specs)} heads; * = val/probe_top1):\n{table}",
              flush=True)


def _first_view(batch: Any) -> Tensor:
    """The first view of a ``(views, targets, ...)`` training batch."""
    views = batch[0]
    if isinstance(views, Sequence) and not isinstance(views, Tensor):
        return views[0]
    return views


@contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` and its submodules in eval mode inside, each restored to its own mode."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)
