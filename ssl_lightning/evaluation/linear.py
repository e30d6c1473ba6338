"""Offline linear evaluation (and fine-tuning) of a pre-trained backbone.

The standard protocol of SimCLR (Chen et al., ICML 2020, §B.5/B.6) and MoCo (He et al., CVPR
2020, §4.1): the backbone of a self-supervised checkpoint is frozen (eval mode, so BatchNorm
statistics stay as pre-trained) and a linear classifier is trained on its features with random
crop + flip, SGD with momentum and a cosine schedule; top-1/top-5 accuracy on the val split.
``finetune=True`` trains the whole network instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones import feature_dim
from ssl_lightning.callbacks.knn import padding_mask, val_sampler
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
        lr: Base learning rate of SGD (before ``lr_scaling``).
        lr_scaling: ``"linear"``: lr × global_batch / 256; ``"none"``: lr as given.
        momentum: SGD momentum.
        weight_decay: Weight decay on weights; biases and norm parameters get none.
        warmup_epochs: Linear warm-up epochs before the cosine decay.
        image_size: Image side used to infer the feature size when the backbone has no
            ``num_features``.
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
        self.classifier = nn.Linear(feature_dim(backbone, image_size), num_classes)
        nn.init.normal_(self.classifier.weight, std=0.01)
        nn.init.zeros_(self.classifier.bias)
        self.finetune = finetune
        self.top5 = min(5, num_classes)
        self._val_rows: list[Tensor] = []  # per val sample: loss, top-1 hit, top-5 hit
        self.train()

    def train(self, mode: bool = True) -> LinearEval:
        """Set train/eval mode; a frozen backbone always stays in eval mode (fixed BN stats)."""
        super().train(mode)
        if not self.finetune:
            self.backbone.eval()
        return self

    def setup(self, stage: str) -> None:
        """Refuse, before training, a classifier whose class count is not the data's; say which
        preprocessing the data applies, warning when the checkpoint was fed otherwise."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if self._checkpoint is not None:
            check_data_preprocessing("LinearEval", self.checkpoint_preprocessing, datamodule,
                                     f"checkpoint {self._checkpoint!r}")
            check_train_view_size("LinearEval", self.checkpoint_preprocessing, datamodule)
        classes = getattr(datamodule, "num_classes", None)
        wanted = self.classifier.out_features
        if isinstance(classes, int) and classes != wanted:
            raise ValueError(
                f"LinearEval has num_classes={wanted}, but the data ({type(datamodule).__name__})"
                f" has {classes} classes: pass --model.num_classes {classes} "
                f"(num_classes={classes} in Python).")

    def features(self, images: Tensor) -> Tensor:
        """Backbone features, without autograd when the backbone is frozen."""
        if self.finetune:
            return self.backbone(images)
        with torch.no_grad():
            return self.backbone(images).detach()

    def forward(self, images: Tensor) -> Tensor:
        """Class logits."""
        return self.classifier(self.features(images))

    def training_step(self, batch: tuple, batch_idx: int) -> Tensor:
        images, targets, *seeds = batch  # the data modules' batches carry the sample seeds
        with keyed_forward(self.sample_keys(seeds[0], batch_idx) if seeds else None):
            logits = self(first_view(images))  # fine-tuning's drop path drawn per sample
        loss = F.cross_entropy(logits.float(), targets)
        check_finite_loss(self, loss, batch_idx)  # every rank stops here together on NaN/inf
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True,
                 batch_size=len(targets))
        top1 = 100 * (logits.detach().argmax(dim=1) == targets).float().mean()
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

    def on_validation_epoch_start(self) -> None:
        self._val_rows.clear()

    def validation_step(
        self, batch: tuple, batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        features = self.backbone(first_view(images))
        if dataloader_idx == len(self.trainer.num_val_batches) - 1:
            logits = self.classifier(features).float()
            hits = logits.topk(self.top5, dim=1).indices == targets[:, None]
            loss = F.cross_entropy(logits, targets, reduction="none")
            self._val_rows.append(torch.stack([loss, hits[:, 0].float(),
                                               hits.any(dim=1).float()], dim=1).detach())
        return {"features": features, "targets": targets}

    def on_validation_epoch_end(self) -> None:
        if not self._val_rows:  # the same on every rank (equal batch counts per rank)
            return
        rows = torch.cat(self._val_rows)
        self._val_rows.clear()
        sampler = val_sampler(self.trainer, len(self.trainer.num_val_batches) - 1)
        rows = rows[padding_mask(len(rows), sampler, rows.device)]
        totals = torch.cat([rows.double().sum(dim=0), rows.new_tensor([len(rows)]).double()])
        loss, top1, top5, count = (all_reduce_mean_no_grad(totals) * world_size()).tolist()
        if count == 0:
            return
        # Already global values; sync_dist keeps Lightning's epoch reduction the same on all ranks.
        self.log("val/loss", loss / count, sync_dist=True)
        self.log("val/top1", 100 * top1 / count, prog_bar=True, sync_dist=True)
        self.log("val/top5", 100 * top5 / count, sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        hp = self.hparams
        modules = [self.backbone, self.classifier] if self.finetune else [self.classifier]
        if self.trainer.train_dataloader is None:  # max_steps without max_epochs: not loaded yet
            self.trainer.fit_loop.setup_data()
        global_batch = global_batch_size(self.trainer, hp.lr_scaling)
        lr = scale_lr(hp.lr, global_batch, hp.lr_scaling)
        optimizer = build_optimizer(
            "sgd", split_decay_groups(modules, hp.weight_decay), lr=lr, momentum=hp.momentum
        )
        scheduler = run_schedule(self.trainer, optimizer, hp.warmup_epochs,
                                 global_batch_size=global_batch)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
