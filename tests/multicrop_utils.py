"""Helpers shared by the DINO/SwAV/multi-crop tests: a call-counting wrapper and tiny
deterministic multi-crop data (the stop-and-resume harness is ``momentum_utils.fit_and_resume``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ssl_lightning.backbones import ViT
from ssl_lightning.testing.trainer_runs import PrecomputedViews

#: 2 global crops of 16 px and 2 local crops of 8 px.
VIEW_SIZES = (16, 16, 8, 8)


class CountingModule(nn.Module):
    """Wraps a module and records the input shape of every call."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[tuple[int, ...]] = []
        self.num_features = getattr(module, "num_features", None)

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.calls.append(tuple(x.shape))
        return self.module(x)


def multicrop_loader(num_samples: int = 16, batch_size: int = 4) -> DataLoader:
    """Deterministic multi-crop batches in order (4 steps per epoch with the defaults)."""
    return DataLoader(PrecomputedViews(num_samples, VIEW_SIZES), batch_size=batch_size,
                      shuffle=False, drop_last=True)


#: Small heads and AdamW settings of the DINO family's method tests.
DINO_SMALL = dict(head_out_dim=32, head_hidden_dim=16, head_bottleneck_dim=8, optimizer="adamw",
                  lr=1e-3, lr_scaling="none", warmup_epochs=0, weight_decay=0.04,
                  warmup_teacher_temperature_epochs=1, freeze_last_layer_epochs=1)


def masked_vit(depth: int = 2, **kwargs) -> ViT:  # type: ignore[no-untyped-def]
    """A 16 px ViT (patch 4, width 16) with a mask token, for iBOT / DINOv2 / DINOv3."""
    return ViT(image_size=16, patch_size=4, embed_dim=16, depth=depth, num_heads=2,
               mask_token=True, **kwargs)


def multicrop_views(batch: int = 4) -> list[torch.Tensor]:
    """2 global 16 px and 2 local 8 px crops (seeded)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 3, s, s, generator=g) for s in (16, 16, 8, 8)]


def small_msn(cls: Any = None, **kw: Any) -> Any:
    """A seeded MSN (or ``cls``, e.g. PMSN) on a 16 px ViT (patch 4, 2 blocks), 10 prototypes,
    mask ratio 0.25."""
    from ssl_lightning.methods import MSN

    torch.manual_seed(0)
    args = dict(projection_hidden_dim=16, projection_dim=8, num_prototypes=10,
                head_batch_norm=False, image_size=16, mask_ratio=0.25)
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
              drop_path_rate=kw.pop("drop_path_rate", 0.0))
    return (cls or MSN)(vit, **{**args, **kw})


def msn_views(batch: int = 4) -> list[torch.Tensor]:
    """A target, an anchor (16 px) and two focal (8 px) views (seeded)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, s, s, generator=g) for s in (16, 16, 8, 8)]
