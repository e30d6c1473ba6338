"""Online linear probe: a linear classifier trained on the detached backbone features.

The standard SSL monitor (e.g. solo-learn's online classifier, the BYOL/SimCLR "online linear
evaluation"; Chen et al., ICML 2020, §B.9 use a probe on stop-gradient features): it costs one
``Linear`` forward/backward per step, never changes the backbone, and tracks how linearly
separable the representation is while pre-training runs. A grid of learning rates × weight
decays (``lrs``, ``weight_decays``) trains one head per pair on the same features, each exactly
as if alone (DINOv2's ``eval/linear.py`` grid; see :mod:`ssl_lightning.callbacks.probe_grid`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning._lightning import pl, rank_zero_warn
from ssl_lightning.callbacks.knn import gather_variable, padding_mask, val_sampler
from ssl_lightning.callbacks.probe_grid import LinearHeads, format_grid, probe_grid
from ssl_lightning.distributed import all_reduce_mean_no_grad, world_size


class OnlineProbe(pl.Callback):
    """Trains ``Linear(feature_dim, num_classes)`` on ``training_step``'s detached features.

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

    Args:
        num_classes: Number of classes; read from ``trainer.datamodule.num_classes`` when None
            (the probe disables itself with a warning when neither knows it: unlabeled data).
        feature_dim: Input size; read from ``pl_module.feature_dim`` when None.
        lr: Learning rate of the probe's SGD.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        val_dataloader_idx: Validation dataloader whose accuracy is logged as ``val/probe_top1``.
        lrs: Learning rates of a grid of heads (``[lr]`` when None).
        weight_decays: Weight decays of the grid (``[weight_decay]`` when None).
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
        self.specs = probe_grid(lrs or [lr], weight_decays or [weight_decay])
        self.best_head = 0
        self._grid_top1: list[float] | None = None
        self.linear: LinearHeads | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending_state: dict[str, Any] | None = None
        self._val_hits: list[Tensor] = []

    # ------------------------------------------------------------------------ building / state
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.linear is not None:
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
        # Zero init: deterministic and identical on every rank without a broadcast (the problem
        # is convex, so nothing is lost against a random init).
        self.linear = LinearHeads(self.specs, {(1, "pooled"): feature_dim}, num_classes,
                                  init_std=0.0)
        self.optimizer = torch.optim.SGD(  # weight decay on the bias too, as before the grid
            [{"params": list(head.parameters()), "lr": spec.lr,
              "weight_decay": spec.weight_decay}
             for spec, head in zip(self.specs, self.linear.heads, strict=True)],
            lr=self.lr, momentum=self.momentum,
        )

    def state_dict(self) -> dict[str, Any]:
        if self.linear is None or self.optimizer is None:
            return {}
        if self._pending_state is not None:  # restored but not used yet
            return self._pending_state
        return {"linear": self.linear.state_dict(), "optimizer": self.optimizer.state_dict(),
                "best_head": self.best_head}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied once the probe sits on the module's device, so that the optimiser state is
        # cast to that device (Lightning restores callbacks before moving the model).
        self._pending_state = state_dict or None

    def _ready(self, pl_module: pl.LightningModule) -> LinearHeads:
        if self.linear is None or self.optimizer is None:
            raise RuntimeError("OnlineProbe used before setup().")
        if self.linear.heads[0].weight.device != pl_module.device:
            self.linear.to(pl_module.device)
        if self._pending_state is not None:
            linear = self._pending_state["linear"]
            if "weight" in linear:  # a checkpoint from before the grid: its one nn.Linear
                linear = {f"heads.0.{key}": value for key, value in linear.items()}
            self.linear.load_state_dict(linear)
            self.optimizer.load_state_dict(self._pending_state["optimizer"])
            self.best_head = int(self._pending_state.get("best_head", 0))
            self._pending_state = None
        return self.linear

    # ------------------------------------------------------------------------------- training
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        if self.linear is None:
            return
        linear = self._ready(pl_module)
        features = outputs["features"].detach().float()
        targets = outputs["targets"].detach().to(features.device)
        # One collective for both: targets ride along as an extra (exact) float column.
        packed = gather_variable(torch.cat([features, targets.float().unsqueeze(1)], dim=1))
        features, targets = packed[:, :-1], packed[:, -1].long()
        labeled = targets >= 0
        if not labeled.any():
            return
        features, targets = features[labeled], targets[labeled]
        with torch.enable_grad(), torch.autocast(features.device.type, enabled=False):
            logits = linear({(1, "pooled"): features})  # (heads, B, classes)
            # The sum: each head gets the gradient of its own loss (as if trained alone).
            losses = torch.stack([F.cross_entropy(head, targets) for head in logits])
            self.optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
            losses.sum().backward()
            self.optimizer.step()  # type: ignore[union-attr]
        accuracy = (logits[self.best_head].detach().argmax(dim=1) == targets).float().mean()
        pl_module.log("train/probe_acc", accuracy, on_step=True, on_epoch=True, sync_dist=True,
                      batch_size=len(targets))
        loss = losses.detach().sum() / len(losses)
        pl_module.log("train/probe_loss", loss, on_step=True, on_epoch=True,
                      sync_dist=True, batch_size=len(targets))

    # ----------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_hits.clear()

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:
        if dataloader_idx != self.val_dataloader_idx or self.linear is None:
            return
        linear = self._ready(pl_module)
        with torch.no_grad(), torch.autocast(pl_module.device.type, enabled=False):
            predictions = linear({(1, "pooled"): outputs["features"].detach().float()}).argmax(2)
        targets = outputs["targets"].to(predictions.device)
        # Per sample and head: correct/incorrect; unlabeled samples are -1, skipped at epoch end.
        self._val_hits.append(torch.where(targets >= 0, (predictions == targets).long(), -1).T)

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
