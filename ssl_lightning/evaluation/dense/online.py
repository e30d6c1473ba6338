"""An online dense probe during pre-training: dense kNN segmentation (the Hummingbird protocol,
:mod:`ssl_lightning.evaluation.dense.seg_knn`) of the method's backbone on a small labelled
segmentation set, at the end of validation; no training, so it costs one forward of the set."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from ssl_lightning._lightning import pl
from ssl_lightning.data.dense_layouts import IGNORE_INDEX, SegLayout
from ssl_lightning.data.dense_pairs import SegmentationDataModule
from ssl_lightning.distributed import rank, world_size
from ssl_lightning.evaluation.dense.frozen import patch_features
from ssl_lightning.evaluation.dense.metrics import ConfusionMatrix
from ssl_lightning.evaluation.dense.seg_knn import bank_patches, gather_bank, knn_label_maps


def dense_knn_scores(backbone: nn.Module, bank: Dataset, queries: Dataset, num_classes: int,
                     ks: Sequence[int], temperature: float = 0.02,
                     patches_per_image: int | None = None, chunk_size: int = 4096,
                     device: torch.device | None = None) -> dict[int, dict[str, Tensor]]:
    """Per k, the segmentation scores of dense kNN with ``backbone`` (as it is: call it in eval
    mode). Rank r of W takes the items r, r + W, ... of both datasets; the bank is gathered and
    the confusion matrices summed, so any number of processes gives the scores of one (every
    rank must call it)."""
    device = device or torch.device("cpu")
    world, me = world_size(), rank()
    rows, dists, owners = [], [], []
    for i in range(me, len(bank), world):  # type: ignore[arg-type]
        image, mask = bank[i]
        feats, dist, owner = bank_patches(patch_features(backbone, image[None].to(device)),
                                          mask[None].to(device), num_classes,
                                          patches_per_image, [i])
        rows.append(feats)
        dists.append(dist)
        owners.append(owner)
    if not rows:
        raise ValueError("The dense kNN bank of a process is empty: use at least as many bank "
                         "images as processes.")
    features, labels = gather_bank(torch.cat(rows), torch.cat(dists), torch.cat(owners))
    matrices = {k: ConfusionMatrix(num_classes, IGNORE_INDEX) for k in ks}
    for i in range(me, len(queries), world):  # type: ignore[arg-type]
        image, mask = queries[i]
        maps = knn_label_maps(patch_features(backbone, image[None].to(device)), features,
                              labels, ks, temperature, chunk_size)
        for k, dist in maps.items():
            full = F.interpolate(dist, size=mask.shape[-2:], mode="bilinear",
                                 align_corners=False)
            matrices[k].update(full.argmax(dim=1), mask[None].to(device))
    return {k: matrix.compute() for k, matrix in matrices.items()}


class DenseKNNProbe(pl.Callback):
    """Dense kNN segmentation mIoU of ``pl_module.backbone`` at the end of validation.

    Logs ``val/dense_knn_miou_k<k>`` (percent) every ``every_n_epochs`` validations. The data
    is a :class:`~ssl_lightning.data.dense_pairs.SegmentationDataModule` of ``root`` (its
    layouts): the bank its training images (at most ``bank_images``, resized and centre-cropped
    to ``crop_size``), the queries its val images (shorter side ``eval_size``). Exact under
    DDP (see :func:`dense_knn_scores`).

    Args:
        root: The segmentation dataset folder.
        num_classes: Its number of classes.
        layout: Its folder layout.
        ks: Numbers of neighbours.
        temperature: Softmax temperature of the neighbours' similarities.
        crop_size: Side of the bank images.
        eval_size: Shorter side of the query images (None: as stored).
        bank_images: Training images in the bank (None: all).
        patches_per_image: Bank patches per image (None: all).
        every_n_epochs: Run at every n-th validation.
    """

    def __init__(self, root: str, num_classes: int, layout: SegLayout = "folders",
                 ks: Sequence[int] = (10,), temperature: float = 0.02, crop_size: int = 224,
                 eval_size: int | None = 224, bank_images: int | None = 1000,
                 patches_per_image: int | None = None, every_n_epochs: int = 1) -> None:
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}.")
        self.data = SegmentationDataModule(root, num_classes, layout=layout, crop_size=crop_size,
                                           eval_size=eval_size, bank_images=bank_images,
                                           eval_batch_size=1, num_workers=0)
        self.num_classes, self.ks, self.temperature = num_classes, list(ks), temperature
        self.patches_per_image, self.every_n_epochs = patches_per_image, every_n_epochs
        self._validations = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Find and check the pairs before any step (bad pairs are named here)."""
        self.data.setup(stage)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule
                                ) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if self._validations % self.every_n_epochs:
            return
        bank, queries = (loader.dataset for loader in self.data.val_dataloader())
        backbone = getattr(pl_module, "backbone")  # noqa: B009 (every method has one)
        scores = dense_knn_scores(backbone, bank, queries, self.num_classes, self.ks,
                                  self.temperature, self.patches_per_image,
                                  device=pl_module.device)
        for k, values in scores.items():
            pl_module.log(f"val/dense_knn_miou_k{k}", values["miou"].float(), sync_dist=True)
