"""Collapse monitor: embedding std and RankMe per validation epoch.

- Std of the L2-normalised embeddings, averaged over dimensions (Chen & He, "Exploring Simple
  Siamese Representation Learning", CVPR 2021, §4.1): about ``1/sqrt(d)`` for well-spread
  embeddings, 0 when every sample maps to the same point.
- RankMe (Garrido et al., "RankMe: Assessing the Downstream Performance of Pretrained
  Self-Supervised Representations by Their Rank", ICML 2023): ``exp(-sum_k p_k log p_k)`` with
  ``p_k = sigma_k / ||sigma||_1 + eps`` over the singular values of the (N, d) embedding matrix;
  between 1 (all embeddings on one line) and ``min(N, d)``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_lightning._lightning import pl
from ssl_lightning.callbacks.features import ValFeatureCollector


class CollapseWarning(UserWarning):
    """The representation has collapsed (constant output or rank ~1)."""


def embedding_std(z: Tensor) -> Tensor:
    """Mean over dimensions of the per-dimension std (over samples) of L2-normalised ``z``."""
    z = F.normalize(z.float(), dim=1)
    return z.std(dim=0).mean()


def rankme(z: Tensor, eps: float = 1e-7) -> Tensor:
    """RankMe effective rank of the embedding matrix ``z`` (N, d) (Garrido et al., 2023, Eq. 1)."""
    sigma = torch.linalg.svdvals(z.float())
    p = sigma / sigma.sum() + eps
    return torch.exp(-(p * p.log()).sum())


class CollapseMonitor(ValFeatureCollector):
    """Logs ``val/embedding_std`` and ``val/rankme`` each validation epoch and warns on collapse.

    Uses the ``features`` returned by ``validation_step`` (backbone features) of one val
    dataloader, gathered over ranks. A :class:`CollapseWarning` is raised when
    ``embedding_std * sqrt(d) < min_std_ratio`` or ``rankme < min_rankme``.

    Args:
        min_std_ratio: Collapse threshold for the std relative to the healthy ``1/sqrt(d)``.
        min_rankme: Collapse threshold for RankMe (1 = complete collapse).
        dataloader_idx: Val dataloader to use (``-1``: the last, the val split).
        max_samples: Samples used (the SVD costs O(N d min(N, d))).
    """

    def __init__(
        self,
        min_std_ratio: float = 0.05,
        min_rankme: float = 1.5,
        dataloader_idx: int = -1,
        max_samples: int = 4096,
    ) -> None:
        super().__init__(dataloader_idx, max_samples)
        if not 0 <= min_std_ratio < 1:
            raise ValueError(f"min_std_ratio must be in [0, 1), got {min_std_ratio}.")
        if min_rankme < 1:
            raise ValueError(f"min_rankme must be >= 1, got {min_rankme}.")
        self.min_std_ratio = min_std_ratio
        self.min_rankme = min_rankme

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        collected = self.collected()
        if collected is None or trainer.sanity_checking:
            return
        z = collected[0]
        if not bool(torch.isfinite(z).all()):  # gathered: the same decision on every rank
            pl_module.log("val/embedding_std", math.nan)
            pl_module.log("val/rankme", math.nan)
            if trainer.is_global_zero:
                warnings.warn(
                    f"The validation embeddings at epoch {trainer.current_epoch} contain NaN/inf "
                    "values: the weights have diverged (see the training loss); embedding std and "
                    "RankMe are logged as NaN.", CollapseWarning, stacklevel=2,
                )
            return
        std, rank = embedding_std(z), rankme(z)
        pl_module.log("val/embedding_std", std.item())
        pl_module.log("val/rankme", rank.item())
        std_ratio = std.item() * math.sqrt(z.shape[1])
        if std_ratio < self.min_std_ratio or rank.item() < self.min_rankme:
            if trainer.is_global_zero:
                warnings.warn(
                    f"Representation collapse at epoch {trainer.current_epoch}: embedding std "
                    f"{std.item():.2e} = {std_ratio:.3f}/sqrt(d) (healthy ~1/sqrt(d), threshold "
                    f"{self.min_std_ratio}/sqrt(d)), RankMe {rank.item():.2f} of at most "
                    f"{min(z.shape)} (threshold {self.min_rankme}). Check the loss, learning rate "
                    "and augmentations.",
                    CollapseWarning,
                    stacklevel=2,
                )
