"""Helpers for the momentum-teacher tests: precomputed views and a stop-and-resume harness."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset


class ViewsDataset(Dataset):
    """``n`` samples of ``num_views`` fixed random views (3, size, size) and a label each."""

    def __init__(self, n: int = 16, num_views: int = 2, size: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.views = [torch.randn(n, 3, size, size, generator=g) for _ in range(num_views)]
        self.targets = torch.arange(n) % 10

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return [v[i] for v in self.views], self.targets[i]


def views_loader(n: int = 16, batch_size: int = 4, **kwargs) -> DataLoader:  # type: ignore[no-untyped-def]
    """A deterministic (unshuffled) train loader of :class:`ViewsDataset`."""
    return DataLoader(ViewsDataset(n, **kwargs), batch_size=batch_size, shuffle=False,
                      drop_last=True)


def cpu_trainer(root: str, max_epochs: int, **kwargs) -> pl.Trainer:  # type: ignore[no-untyped-def]
    """A quiet single-process CPU trainer."""
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        num_sanity_val_steps=0, **kwargs,
    )


def state_of(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    """A detached copy of the model's full state dict (parameters and persistent buffers)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit_and_resume(
    make_model: Callable[[], pl.LightningModule],
    make_loader: Callable[[], DataLoader],
    root: str,
    epochs: int = 2,
    make_callbacks: Callable[[], list[pl.Callback]] = list,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fit ``epochs`` epochs uninterrupted (checkpointing every epoch), then resume a fresh model
    from the checkpoint of epoch ``epochs − 1`` and fit to the end. ``make_callbacks`` gives
    each trainer its own fresh callbacks.

    Returns:
        The final state dicts of the uninterrupted and of the resumed run.
    """
    torch.manual_seed(0)
    model = make_model()
    ckpt = ModelCheckpoint(dirpath=f"{root}/ckpt", save_top_k=-1, every_n_epochs=1,
                           filename="{epoch}")
    cpu_trainer(root, epochs, callbacks=[ckpt, *make_callbacks()]).fit(model, make_loader())
    full = state_of(model)
    torch.manual_seed(1)  # a different initialisation: everything must come from the checkpoint
    resumed = make_model()
    cpu_trainer(root, epochs, callbacks=make_callbacks(), enable_checkpointing=False).fit(
        resumed, make_loader(), ckpt_path=f"{root}/ckpt/epoch={epochs - 2}.ckpt"
    )
    return full, state_of(resumed)


#: Small heads and the plain SGD schedule of the momentum methods' tests (8 px views).
COMMON = dict(projection_hidden_dim=16, projection_dim=8, optimizer="sgd", lr=0.5,
              lr_scaling="none", warmup_epochs=0, image_size=8)


def assert_own_ema_callback_and_frozen_teacher(model: Any, schedule: str) -> None:
    """``model`` supplies its :class:`EMACallback` (momentum 0.9, ``schedule``), and its two
    teachers take no gradient and are not among the trainable modules."""
    from ssl_lightning.callbacks import EMACallback

    (callback,) = model.configure_callbacks()
    assert isinstance(callback, EMACallback)
    assert callback.momentum_base == 0.9
    assert callback.schedule == schedule
    teachers = {id(t) for _, t in model.ema_pairs()}
    assert len(teachers) == 2
    for _, teacher in model.ema_pairs():
        assert all(not p.requires_grad for p in teacher.parameters())
    trainable = {id(p) for m in model.trainable_modules() for p in m.parameters()}
    assert not any(id(p) in trainable for _, t in model.ema_pairs() for p in t.parameters())


def assert_resume_is_exact(make: Callable[[], pl.LightningModule], root: str) -> dict:
    """Teacher, queue, pointer and the tau position after fit 2 epochs == fit 1 + resume; the
    EMA ran (the teachers left their initial values and differ from the students). Returns the
    final state."""
    full, resumed = fit_and_resume(make, lambda: views_loader(16, 4, size=8), root, epochs=2)
    teacher_keys = [k for k in full if k.startswith("teacher_")]
    assert teacher_keys
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    # The EMA ran (the teacher left its initial value) with tau < 1 (it is not the student),
    # so equality above pins the tau sequence of the resumed run.
    torch.manual_seed(0)
    initial = make().state_dict()
    assert any(not torch.equal(full[k], initial[k]) for k in teacher_keys)
    teacher_of = {k.split("_", 1)[1]: k for k in teacher_keys}  # student name -> teacher name
    assert any(not torch.equal(full[s], full[t]) for s, t in teacher_of.items()
               if full[s].is_floating_point())
    return full


def loss_predictions_and_targets(model: Any, views: list[torch.Tensor],
                                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """After making every teacher differ from its student (so a swapped pairing shows): the
    model's training loss of ``views`` (detached), each view's online prediction
    ``predictor(projector(backbone(v)))`` and each view's teacher target (teacher projector of
    teacher backbone), for methods whose ``ema_pairs`` are (backbone, projector)."""
    teacher_bb, teacher_proj = (t for _, t in model.ema_pairs())
    for _, teacher in model.ema_pairs():
        for p in teacher.parameters():
            p.data.add_(0.1 * torch.randn_like(p))
    loss, _ = model.training_loss(views)
    with torch.no_grad():
        predictions = [model.predictor(model.projector(model.backbone(v))) for v in views]
        targets = [teacher_proj(teacher_bb(v)) for v in views]
    return loss.detach(), predictions, targets
