"""Tiny MAE / I-JEPA / SimMIM / AIM models for the masked-image tests (16 px images, 2 px
patches: 8x8 grid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import AIM, IJEPA, MAE, SimMIM

SIZE, PATCH, GRID = 16, 2, 8


def tiny_vit(**kwargs: Any) -> ViT:
    """A 1-block ViT of width 32 on 16 px images with 2 px patches."""
    args: dict[str, Any] = dict(image_size=SIZE, patch_size=PATCH, embed_dim=32, depth=1,
                                num_heads=2, pos_embed="sincos")
    return ViT(**{**args, **kwargs})


def tiny_mae(**kwargs: Any) -> MAE:
    args: dict[str, Any] = dict(decoder_dim=16, decoder_depth=1, decoder_heads=2,
                                image_size=SIZE, lr=1e-3, lr_scaling="none", warmup_epochs=0)
    return MAE(tiny_vit(), **{**args, **kwargs})


def tiny_ijepa(**kwargs: Any) -> IJEPA:
    args: dict[str, Any] = dict(predictor_dim=16, predictor_depth=1, predictor_heads=2,
                                image_size=SIZE, lr=1e-3, lr_scaling="none", warmup_epochs=0,
                                momentum_base=0.9)
    return IJEPA(tiny_vit(pool="mean"), **{**args, **kwargs})


def tiny_simmim(**kwargs: Any) -> SimMIM:
    """SimMIM on the tiny ViT with a mask token, mask units of 2 x 2 patches."""
    args: dict[str, Any] = dict(mask_patch_size=2 * PATCH, image_size=SIZE, lr=1e-3,
                                lr_scaling="none", warmup_epochs=0)
    return SimMIM(tiny_vit(mask_token=True), **{**args, **kwargs})


def tiny_aim(**kwargs: Any) -> AIM:
    args: dict[str, Any] = dict(head_hidden_dim=16, head_layers=2, image_size=SIZE, lr=1e-3,
                                lr_scaling="none", warmup_epochs=0)
    return AIM(tiny_vit(pool="mean"), **{**args, **kwargs})


def count_tokens(module: torch.nn.Module) -> list[int]:
    """Token counts entering ``module`` (one entry per call)."""
    counts: list[int] = []
    module.register_forward_pre_hook(lambda m, args: counts.append(args[0].shape[1]))
    return counts


def assert_linear_eval_reads_the_checkpoint(model: Any, prefix: str, pool: str,
                                            root: Path) -> None:
    """``model`` trained 2 steps and saved: LinearEval on ``prefix`` of its checkpoint gives
    the method's own evaluation features and trains."""
    from evaluation_helpers import tiny_trainer
    from momentum_utils import views_loader
    from torch.utils.data import DataLoader, TensorDataset

    from ssl_lightning.evaluation import LinearEval

    trainer = tiny_trainer(max_steps=2)
    trainer.fit(model, views_loader(8, 4, num_views=1, size=SIZE))
    path = str(root / "pretrain.ckpt")
    trainer.save_checkpoint(path)
    linear = LinearEval(tiny_vit(pool=pool), num_classes=4, checkpoint=path,
                        checkpoint_prefix=prefix, lr=0.1, lr_scaling="none")
    x = torch.randn(8, 3, SIZE, SIZE)
    model.eval()
    torch.testing.assert_close(linear.backbone(x), model.validation_step((x, x), 0)["features"])
    data = TensorDataset(torch.randn(16, 3, SIZE, SIZE), torch.arange(16) % 4)
    fit = tiny_trainer(max_epochs=1)
    fit.fit(linear, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    assert 0.0 <= float(fit.callback_metrics["val/top1"]) <= 100.0


def assert_resume_is_exact(factory: Any, root: Path) -> None:
    """Fit 2 epochs == fit 1, resume from its checkpoint (fresh process RNG), fit 1 more: the
    masks of epoch 2 come back with the checkpointed RNG state."""
    from momentum_utils import fit_and_resume, views_loader

    full, resumed = fit_and_resume(factory, lambda: views_loader(16, 4, num_views=1, size=SIZE),
                                   str(root), epochs=2)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


def sample_keys(batch: int, seed: int = 0) -> Any:
    """Per-sample keys of samples ``seed .. seed + batch - 1`` (epoch 7, batch 0, rank 0)."""
    from ssl_lightning.training.sample_rng import SampleKeys

    return SampleKeys.from_seeds(torch.arange(seed, seed + batch, dtype=torch.int64), 7, 0, 1, 0)


def float64_images(batch: int = 4) -> torch.Tensor:
    """Seeded float64 images of :data:`SIZE` px."""
    return torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
