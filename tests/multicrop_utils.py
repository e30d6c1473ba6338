"""Helpers shared by the DINO/SwAV/multi-crop tests: a call-counting wrapper and tiny
deterministic multi-crop data (the stop-and-resume harness is ``momentum_utils.fit_and_resume``)."""

from __future__ import annotations

from torch import nn
from torch.utils.data import DataLoader

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
