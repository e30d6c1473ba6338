"""Shared pieces of the evaluation tests: a quiet trainer and real method checkpoints."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from torch import nn
from torch.utils.data import DataLoader

from ssl_lightning.methods import SimCLR
from ssl_lightning.testing.trainer_runs import PrecomputedViews


def tiny_trainer(**kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer (no logger, checkpoints, progress bar or sanity check)."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def simclr_checkpoint(backbone: nn.Module, path: str, view_size: int = 8, steps: int = 2) -> SimCLR:
    """Pre-train a SimCLR on random views for ``steps`` steps and save a real Lightning ckpt.

    The steps move the weights and the BatchNorm statistics away from their initial values.
    """
    model = SimCLR(backbone, projection_hidden_dim=16, projection_dim=8, optimizer="sgd",
                   lr=0.1, lr_scaling="none", warmup_epochs=0)
    loader = DataLoader(PrecomputedViews(8, (view_size, view_size)), batch_size=4)
    trainer = tiny_trainer(max_steps=steps)
    trainer.fit(model, loader)
    trainer.save_checkpoint(path)
    return model

