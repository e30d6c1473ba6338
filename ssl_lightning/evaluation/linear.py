"""Offline linear evaluation (and fine-tuning) of a pre-trained backbone.

The standard protocol of SimCLR (Chen et al., ICML 2020, §B.5/B.6) and MoCo (He et al., CVPR
2020, §4.1): the backbone of a self-supervised checkpoint is frozen (eval mode, so BatchNorm
statistics stay as pre-trained) and a linear classifier is trained on its features with random
crop + flip, SGD with momentum and a cosine schedule; top-1/top-5 accuracy on the val split.
``finetune=True`` trains the whole network instead.

A grid of heads (``lrs`` × ``weight_decays`` × ``last_blocks`` × ``poolings``, DINOv2's
``eval/linear.py`` protocol: 13 learning rates × {1, 4} last blocks × {[CLS], [CLS] + mean
patch}) trains on one frozen forward per batch (:mod:`ssl_lightning.callbacks.probe_grid`);
the head with the best val top-1 is the one ``val/top1`` reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning._lightning import fit_train_dataloader, rank_zero_only
from ssl_lightning.callbacks.knn import padding_mask, val_sampler
from ssl_lightning.callbacks.probe_grid import (
    LinearHeads,
    format_grid,
    head_param_groups,
    probe_grid,
    source_dims,
    source_features,
)
from ssl_lightning.data.transforms import LinearEvalTransform, PresetName, get_preset
from ssl_lightning.distributed import all_reduce_mean_no_grad, world_size
from ssl_lightning.evaluation.checkpoint import (
    DEFAULT_PREFIX,
    backbone_from_checkpoint,
    resolve_checkpoint,
)
from ssl_lightning.evaluation.preprocessing import (
    check_data_preprocessing,
    check_train_view_size,
    recorded_preprocessing,
)
from ssl_lightning.losses.numerics import at_least_fp32
from ssl_lightning.optim import (
    build_optimizer,
    global_batch_size,
    run_schedule,
    scale_lr,
    split_decay_groups,
)
from ssl_lightning.training.divergence import check_finite_loss, check_finite_weights
from ssl_lightning.training.sample_rng import keyed_forward
from ssl_lightning.training.step_rng import SeededSteps


def first_view(images: Tensor | Sequence[Tensor]) -> Tensor:
    """The image tensor of a batch whose inputs are a tensor or a list of views."""
    return images if isinstance(images, Tensor) else images[0]


class LinearEval(SeededSteps):
    """A linear classifier on a (frozen) pre-trained backbone.

    Training batches are ``(images, targets)``, where ``images`` is a tensor or a list of views
    (the first is used). With several val dataloaders (the data modules give ``[train_eval,
    val]``), accuracy is measured on the last one only. Logs ``train/loss``, ``train/top1``,
    ``val/loss``, ``val/top1`` and ``val/top5`` (accuracies in percent, like ``val/knn_top1``).

    With a grid of several heads, every head trains on the same frozen features with its own
    learning rate and weight decay (its own optimiser parameter groups: exactly as if trained
    alone); ``train/loss`` is the mean of the heads' losses; each validation logs every head's
    top-1 as ``val/grid_top1/<head name>`` and picks the head with the best top-1 (the first on
    ties), whose loss and accuracies are ``val/loss``, ``val/top1`` and ``val/top5`` and whose
    logits ``forward`` returns; the end of fit prints the table of all heads. The default grid
    is one head: today's single-probe numbers exactly.

    Under DDP the metrics are those of one process over the whole data: ``train/top1`` is
    reduced by Lightning with the other epoch metrics (one sample-weighted mean over ranks);
    the val metrics sum per-sample hits over ranks without the duplicates that
    ``DistributedSampler`` pads the last batch with. No hook makes a collective of its own at
    ``on_train_epoch_end``, where rank 0's progress bar is already reducing the epoch metrics.

    Args:
        backbone: The backbone the checkpoint was trained with (features ``(B, D)``); ``None``:
            rebuilt from the checkpoint's ``backbone_spec`` (every ssl_lightning checkpoint has
            one). Given, it overrides the spec.
        num_classes: Number of classes (required; after ``backbone`` so that positional calls
            ``LinearEval(backbone, 10, ...)`` keep working).
        checkpoint: Path of a pre-training checkpoint of any ssl_lightning method, or
            ``"random"`` to evaluate the backbone as constructed (the random-init baseline, or
            weights you loaded yourself). Required: ``None`` is refused with a ValueError.
        checkpoint_prefix: State-dict prefix of the backbone in the checkpoint
            (e.g. ``"teacher_backbone."`` to evaluate an EMA teacher, if the method has one).
        finetune: Train the backbone too (in train mode) instead of freezing it.
        lr: Base learning rate of SGD (before ``lr_scaling``); the grid's when ``lrs`` is None.
        lr_scaling: ``"linear"``: lr × global_batch / 256; ``"none"``: lr as given.
        momentum: SGD momentum.
        weight_decay: Weight decay on weights; biases and norm parameters get none. The grid's
            when ``weight_decays`` is None.
        warmup_epochs: Linear warm-up epochs before the cosine decay.
        image_size: Image side used to infer the feature size when the backbone has no
            ``num_features``.
        optimizer: ``"sgd"`` (with ``momentum``) or ``"adamw"``.
        lrs: Base learning rates of the grid (e.g. DINOv2's 13: 1e-5, 2e-5, 5e-5, ..., 0.1).
        weight_decays: Weight decays of the grid.
        last_blocks: Numbers of last blocks whose tokens are concatenated (token backbones).
        poolings: Feature poolings of the grid: ``pooled`` (the backbone's output, any
            backbone), ``cls``, ``mean``, ``cls+mean`` (ViTs; see
            :func:`~ssl_lightning.callbacks.probe_grid.source_features`).
        rng_seed: Seed of the per-batch reseeding of stochastic depth / dropout when
            fine-tuning (see :class:`~ssl_lightning.training.step_rng.SeededSteps`); ``None``:
            the run's seed.
    """

    def __init__(
        self,
        backbone: nn.Module | None = None,
        num_classes: int | None = None,
        checkpoint: str | None = None,
        checkpoint_prefix: str = DEFAULT_PREFIX,
        finetune: bool = False,
        lr: float = 0.1,
        lr_scaling: Literal["none", "linear"] = "linear",
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_epochs: float = 0.0,
        image_size: int = 32,
        rng_seed: int | None = None,
        lrs: list[float] | None = None,
        weight_decays: list[float] | None = None,
        last_blocks: list[int] | None = None,
        poolings: list[str] | None = None,
        optimizer: Literal["sgd", "adamw"] = "sgd",
    ) -> None:
        super().__init__()
        if num_classes is None:
            raise ValueError("LinearEval needs num_classes (e.g. --model.num_classes 10).")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}.")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}.")
        self.specs = probe_grid(lrs or [lr], weight_decays or [weight_decay], last_blocks or [1],
                                poolings or ["pooled"])
        if any(spec.pooling == "tokens" for spec in self.specs) != (self.head_kind == "tokens"):
            raise ValueError(f"{type(self).__name__} takes the poolings pooled / cls / mean / "
                             "cls+mean; the tokens source is AttentiveEval's.")
        if finetune and len(self.specs) > 1:
            raise ValueError(f"LinearEval finetune=True trains the backbone, so it takes one head;"
                             f" the grid has {len(self.specs)}: give one lr, weight decay, "
                             "last_blocks and pooling.")
        self.save_hyperparameters(ignore=["backbone"])
        path = resolve_checkpoint(checkpoint, "LinearEval")
        if path is not None:
            backbone = backbone_from_checkpoint(path, backbone, checkpoint_prefix)
        elif backbone is None:
            raise ValueError(
                "LinearEval with checkpoint: random needs a backbone (--model.backbone).")
        self._checkpoint = path
        self.checkpoint_preprocessing = recorded_preprocessing(path) if path is not None else None
        self.backbone = backbone
        self.backbone.requires_grad_(finetune)
        #: The feature sources the heads read, in order of first use.
        self.sources = list(dict.fromkeys(spec.source for spec in self.specs))
        self.num_classes = num_classes
        self.classifier = self.build_heads(source_dims(backbone, self.sources, image_size),
                                           num_classes)
        #: The head ``val/top1`` reports (the best at the last validation); a buffer: resumed.
        self.best_head: Tensor
        self.register_buffer("best_head", torch.zeros((), dtype=torch.long))
        self._grid_top1: list[float] | None = None
        self.finetune = finetune
        self.top5 = min(5, num_classes)
        self._val_rows: list[Tensor] = []  # per val sample: loss, top-1 hit, top-5 hit
        self.train()

    #: The source kind the heads read: pooled (B, D) features, or ``tokens`` (attentive).
    head_kind = "pooled"

    def build_heads(self, dims: dict[tuple[int, str], int], num_classes: int) -> nn.Module:
        """The grid's heads: one ``nn.Linear`` per head (:class:`LinearHeads`)."""
        return LinearHeads(self.specs, dims, num_classes)

    def train(self, mode: bool = True) -> LinearEval:
        """Set train/eval mode; a frozen backbone always stays in eval mode (fixed BN stats)."""
        super().train(mode)
        if not self.finetune:
            self.backbone.eval()
        return self

    def training_views(self, preset: PresetName) -> LinearEvalTransform:
        """The training views when the data module is given no ``train_transform``: random
        crops of the checkpoint's recorded crop size and statistics (RGB images), else of the
        data module's ``preset``; prints which (global rank 0)."""
        record = self.checkpoint_preprocessing
        if record is not None and record.get("image_reader") == "rgb":
            preset, origin = record["preset"], "the checkpoint's preprocessing"
            crop, mean, std = int(record["crop_size"]), record["mean"], record["std"]
        else:
            origin = (f"the data module's preset {preset!r} (the checkpoint records no RGB "
                      "preprocessing)")
            defaults = get_preset(preset)
            crop, mean, std = defaults.crop_size, defaults.mean, defaults.std
        views = LinearEvalTransform(preset, crop_size=crop, mean=tuple(mean), std=tuple(std))
        how = "random resized crop" if preset == "imagenet" else "random crop (4 px padding)"
        rank_zero_only(print)(
            f"LinearEval: training views from {origin}: {how} {crop} px + horizontal flip, "
            f"mean {[round(float(m), 4) for m in mean]}, std {[round(float(v), 4) for v in std]}")
        return views

    def setup(self, stage: str) -> None:
        """Refuse, before training, a classifier whose class count is not the data's; say which
        preprocessing the data applies, warning when the checkpoint was fed otherwise."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if self._checkpoint is not None:
            check_data_preprocessing("LinearEval", self.checkpoint_preprocessing, datamodule,
                                     f"checkpoint {self._checkpoint!r}")
            check_train_view_size("LinearEval", self.checkpoint_preprocessing, datamodule)
        classes = getattr(datamodule, "num_classes", None)
        wanted = self.num_classes
        if isinstance(classes, int) and classes != wanted:
            raise ValueError(
                f"LinearEval has num_classes={wanted}, but the data ({type(datamodule).__name__})"
                f" has {classes} classes: pass --model.num_classes {classes} "
                f"(num_classes={classes} in Python).")

    def features(self, images: Tensor) -> dict[tuple[int, str], Tensor]:
        """Every feature source of the grid from one backbone forward, without autograd when
        the backbone is frozen."""
        if self.finetune:
            return source_features(self.backbone, images, self.sources)
        with torch.no_grad():
            out = source_features(self.backbone, images, self.sources)
        return {source: f.detach() for source, f in out.items()}

    def grid_logits(self, images: Tensor) -> Tensor:
        """Class logits of every head, (heads, B, classes)."""
        return self.classifier(self.features(images))

    def forward(self, images: Tensor) -> Tensor:
        """Class logits of the best head (the one ``val/top1`` reports)."""
        return self.grid_logits(images)[int(self.best_head)]

    def training_step(self, batch: tuple, batch_idx: int) -> Tensor:
        images, targets, *seeds = batch  # the data modules' batches carry the sample seeds
        with keyed_forward(self.sample_keys(seeds[0], batch_idx) if seeds else None):
            logits = self.grid_logits(first_view(images))  # fine-tuning's drop path per sample
        # The sum: each head gets the gradient of its own loss (as if trained alone).
        losses = torch.stack([F.cross_entropy(at_least_fp32(head), targets) for head in logits])
        loss = losses.sum()
        check_finite_loss(self, loss, batch_idx)  # every rank stops here together on NaN/inf
        self.log("train/loss", loss.detach() / len(losses), prog_bar=True, on_step=True,
                 on_epoch=True, sync_dist=True, batch_size=len(targets))
        best = logits[int(self.best_head)].detach()
        top1 = 100 * (best.argmax(dim=1) == targets).float().mean()
        self.log("train/top1", top1, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(targets))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop (on every rank) when the update just made left non-finite weights."""
        check_finite_weights(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Never write non-finite weights over the last good checkpoint."""
        check_finite_weights(self, reduce=False)
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read a checkpoint from before the grid: its ``classifier`` was one ``nn.Linear``."""
        state = checkpoint["state_dict"]
        for name in ("weight", "bias"):
            if f"classifier.{name}" in state:
                state[f"classifier.heads.0.{name}"] = state.pop(f"classifier.{name}")
        state.setdefault("best_head", torch.zeros((), dtype=torch.long))

    def on_validation_epoch_start(self) -> None:
        self._val_rows.clear()

    def validation_step(
        self, batch: tuple, batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        sources = source_features(self.backbone, first_view(images),
                                  list(dict.fromkeys([(1, "pooled"), *self.sources])))
        if dataloader_idx == len(self.trainer.num_val_batches) - 1:
            logits = at_least_fp32(self.classifier(sources))  # (heads, B, classes)
            hits = logits.topk(self.top5, dim=2).indices == targets[None, :, None]
            loss = torch.stack([F.cross_entropy(head, targets, reduction="none")
                                for head in logits])
            # per val sample and head: loss, top-1 hit, top-5 hit
            self._val_rows.append(torch.stack([loss, hits[..., 0].float(),
                                               hits.any(dim=2).float()], dim=2)
                                  .transpose(0, 1).detach())
        return {"features": sources[(1, "pooled")], "targets": targets}

    def on_validation_epoch_end(self) -> None:
        if not self._val_rows:  # the same on every rank (equal batch counts per rank)
            return
        rows = torch.cat(self._val_rows)
        self._val_rows.clear()
        sampler = val_sampler(self.trainer, len(self.trainer.num_val_batches) - 1)
        rows = rows[padding_mask(len(rows), sampler, rows.device)]  # (N, heads, 3)
        totals = torch.cat([rows.double().sum(dim=0).flatten(),
                            rows.new_tensor([len(rows)]).double()])
        totals = all_reduce_mean_no_grad(totals) * world_size()
        count = float(totals[-1])
        if count == 0:
            return
        sums = totals[:-1].view(-1, 3).tolist()  # summed loss, top-1 and top-5 hits per head
        top1 = [100 * row[1] / count for row in sums]
        best = max(range(len(top1)), key=lambda i: (top1[i], -i))
        self.best_head.fill_(best)
        self._grid_top1 = top1
        # Already global values; sync_dist keeps Lightning's epoch reduction the same on all ranks.
        if len(top1) > 1:
            for spec, value in zip(self.specs, top1, strict=True):
                self.log(f"val/grid_top1/{spec.name}", value, sync_dist=True)
        loss, _, top5 = sums[best]
        self.log("val/loss", loss / count, sync_dist=True)
        self.log("val/top1", top1[best], prog_bar=True, sync_dist=True)
        self.log("val/top5", 100 * top5 / count, sync_dist=True)

    def on_fit_end(self) -> None:
        """Print every head's last val top-1 and the chosen one (a grid of several heads)."""
        if self._grid_top1 is None or len(self.specs) < 2 or not self.trainer.is_global_zero:
            return
        table = format_grid([s.name for s in self.specs], self._grid_top1, int(self.best_head))
        print(f"{type(self).__name__} grid ({len(self.specs)} heads; * = val/top1):\n{table}",
              flush=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        hp = self.hparams
        fit_train_dataloader(self.trainer)  # max_steps without max_epochs: not loaded yet
        global_batch = global_batch_size(self.trainer, hp.lr_scaling)
        lr_scale = scale_lr(1.0, global_batch, hp.lr_scaling)
        heads = cast(nn.ModuleList, self.classifier.heads)
        groups = head_param_groups(self.specs, list(heads), lr_scale)
        if self.finetune:  # one head (checked in __init__): the backbone at its lr and decay
            spec = self.specs[0]
            groups = [{**g, "lr": spec.lr * lr_scale}
                      for g in split_decay_groups([self.backbone], spec.weight_decay)] + groups
        optimizer = build_optimizer(hp.optimizer, groups,
                                    lr=scale_lr(hp.lr, global_batch, hp.lr_scaling),
                                    momentum=hp.momentum)
        scheduler = run_schedule(self.trainer, optimizer, hp.warmup_epochs,
                                 global_batch_size=global_batch)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
