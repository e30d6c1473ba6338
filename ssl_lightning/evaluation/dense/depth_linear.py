"""Linear depth probe (DINOv3, Siméoni et al. 2025 / DINOv2, Oquab et al. 2023, §7.5 "lin."):
BatchNorm + 1×1 conv on the last block's patch-token map predicting 256 depth bins (AdaBins-style
classification, Bhat et al. 2021: uniform bins between ``min_depth`` and ``max_depth``, the
depth the bins' centres averaged with the head's linearly normalised ReLU scores), upsampled
bilinearly and trained with the scale-invariant log loss (SigLoss, Eigen et al. 2014)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.distributed import all_reduce_sum_no_grad
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX
from ssl_lightning.evaluation.dense.linear_probe import DenseLinearProbe
from ssl_lightning.evaluation.dense.metrics import depth_image_errors, depth_scores, sig_loss


class DepthLinearProbe(DenseLinearProbe):
    """A grid of linear depth heads on a frozen backbone (see :class:`DenseLinearProbe`).

    Logs ``train/loss`` (SigLoss, mean over heads), ``val/rmse_lr<lr>`` per head, and
    ``val/rmse`` (metres), ``val/abs_rel`` and ``val/delta1`` of the head with the lowest RMSE;
    :attr:`results` holds every head's scores. Metrics are per-image means over the val split,
    summed in float64 over ranks.

    Args:
        output: ``"bins"``: ``num_bins`` uniform depth bins (DINOv2/DINOv3's linear depth);
            ``"regression"``: one map, depth = softplus(output) + ``min_depth`` (a ReLU
            there leaves the pixels it zeroes without gradient).
        num_bins: Number of depth bins (256 in DINOv2/DINOv3).
        min_depth / max_depth: Depth range in metres (NYUv2: 0.001 and 10); targets outside
            it are not scored nor trained on.
        **others: See :class:`DenseLinearProbe`.
    """

    def __init__(self, backbone: nn.Module | None = None, checkpoint: str | None = None,
                 checkpoint_prefix: str = DEFAULT_PREFIX,
                 output: Literal["bins", "regression"] = "bins", num_bins: int = 256,
                 min_depth: float = 1e-3, max_depth: float = 10.0,
                 lrs: Sequence[float] = (1e-4, 3e-4, 1e-3, 3e-3), weight_decay: float = 1e-3,
                 warmup_epochs: float = 0.0, crop_size: int = 416, stride: int | None = None,
                 image_size: int = 224) -> None:
        if output not in ("bins", "regression"):
            raise ValueError(f"output must be 'bins' or 'regression', got {output!r}.")
        if not 0 < min_depth < max_depth or num_bins < 2:
            raise ValueError(f"need 0 < min_depth < max_depth and num_bins >= 2, got "
                             f"{min_depth}, {max_depth}, {num_bins}.")
        super().__init__(num_bins if output == "bins" else 1, backbone, checkpoint,
                         checkpoint_prefix, lrs, weight_decay, warmup_epochs, crop_size, stride,
                         image_size)
        self.save_hyperparameters(ignore=["backbone"])
        self.output, self.min_depth, self.max_depth = output, min_depth, max_depth
        self.register_buffer("centers", torch.linspace(min_depth, max_depth, num_bins),
                             persistent=False)
        self.sums = [torch.zeros(4, dtype=torch.float64) for _ in self.heads]
        self.results: dict[str, dict[str, Tensor]] = {}

    def depth(self, output: Tensor) -> Tensor:
        """Depth maps (B, 1, h, w) in metres from a head's output."""
        if self.output == "regression":
            return F.softplus(output.float()) + self.min_depth
        scores = F.relu(output.float()) + 0.1  # DINOv2's linear bin normalisation
        weights = scores / scores.sum(dim=1, keepdim=True)
        centers: Tensor = self.centers  # type: ignore[assignment]
        return (weights * centers.view(1, -1, 1, 1)).sum(dim=1, keepdim=True)

    def head_loss(self, output: Tensor, targets: Tensor) -> Tensor:
        depth = F.interpolate(self.depth(output), size=targets.shape[-2:], mode="bilinear",
                              align_corners=False)[:, 0]
        valid = (targets > self.min_depth) & (targets <= self.max_depth)
        return sig_loss(depth, targets, valid)

    def predict_maps(self, outputs: list[Tensor]) -> list[Tensor]:
        return [self.depth(out) for out in outputs]

    def score(self, head: int, prediction: Tensor, targets: Tensor) -> None:
        rows = depth_image_errors(prediction[:, 0], targets, self.min_depth, self.max_depth)
        self.sums[head] = self.sums[head].to(rows.device) + rows.sum(dim=0)

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self.sums = [torch.zeros_like(s) for s in self.sums]

    def on_validation_epoch_end(self) -> None:
        self.results = {name: depth_scores(all_reduce_sum_no_grad(sums.clone()))
                        for name, sums in zip(self.heads.names(), self.sums, strict=True)}
        for name, scores in self.results.items():
            self.log(f"val/rmse_{name}", scores["rmse"].float(), sync_dist=True)
        best = min(self.results.values(), key=lambda s: float(s["rmse"]))
        for key in ("rmse", "abs_rel", "delta1"):
            self.log(f"val/{key}", best[key].float(), prog_bar=key == "rmse", sync_dist=True)
