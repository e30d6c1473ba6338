"""Dense kNN segmentation with no training (the Hummingbird protocol, Balažević et al., NeurIPS
2023, as CAPI, Darcet et al. 2025, reports it): a memory bank of the training images' patch
features, each labelled with the class distribution of its pixels; every val patch takes the
softmax-weighted (temperature τ) mean label distribution of its k nearest bank patches (cosine
similarity), upsampled bilinearly to the mask; mIoU for each k."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning._lightning import pl
from ssl_lightning.callbacks.knn import gather_variable, val_sampler
from ssl_lightning.data.dense_layouts import IGNORE_INDEX
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX
from ssl_lightning.evaluation.dense.frozen import frozen_backbone, patch_features, real_samples
from ssl_lightning.evaluation.dense.metrics import ConfusionMatrix
from ssl_lightning.evaluation.fewshot import dataset_positions
from ssl_lightning.evaluation.preprocessing import adopt_dense_normalisation, recorded_preprocessing


def patch_label_distributions(masks: Tensor, grid: tuple[int, int], num_classes: int) -> Tensor:
    """``(B, h, w, C)`` share of each class among the labelled pixels of each patch of the
    ``(B, H, W)`` masks cut in a ``grid`` (rows of zeros for patches with no labelled pixel)."""
    one_hot = F.one_hot(masks.masked_fill(masks == IGNORE_INDEX, num_classes).long(),
                        num_classes + 1)[..., :num_classes].permute(0, 3, 1, 2).float()
    counts = F.adaptive_avg_pool2d(one_hot, grid)  # mean over each patch's pixels
    total = counts.sum(dim=1, keepdim=True)
    return (counts / total.clamp(min=1e-12)).permute(0, 2, 3, 1)


def bank_patches(features: Tensor, masks: Tensor, num_classes: int,
                 patches_per_image: int | None, indices: Sequence[int]
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """The memory-bank rows of a batch: L2-normalised patch features ``(N, C)`` of the
    ``(B, C, h, w)`` map, their class shares ``(N, num_classes)`` and the dataset index of
    their image ``(N,)``, without the patches that have no labelled pixel;
    ``patches_per_image`` keeps a random subset of each image, drawn from its dataset index
    (``indices[i]``, so that any split over processes draws the same subsets)."""
    features = F.normalize(features, dim=1)
    grid = (features.shape[-2], features.shape[-1])
    labels = patch_label_distributions(masks, grid, num_classes)
    features = features.permute(0, 2, 3, 1)
    rows, dists, owners = [], [], []
    for i, index in enumerate(indices):
        feats, dist = features[i].flatten(0, 1), labels[i].flatten(0, 1)
        keep = dist.sum(dim=1) > 0
        feats, dist = feats[keep], dist[keep]
        if patches_per_image is not None and len(feats) > patches_per_image:
            generator = torch.Generator().manual_seed(int(index))
            pick = torch.randperm(len(feats), generator=generator)[:patches_per_image]
            feats, dist = feats[pick.to(feats.device)], dist[pick.to(feats.device)]
        rows.append(feats)
        dists.append(dist)
        owners.append(torch.full((len(feats),), int(index), device=feats.device))
    return torch.cat(rows), torch.cat(dists), torch.cat(owners)


def gather_bank(features: Tensor, labels: Tensor, owners: Tensor) -> tuple[Tensor, Tensor]:
    """The bank rows of every rank in dataset order (the order of one process, so that the
    neighbours' ties break alike): stably sorted by their image's dataset index ``owners``."""
    order = torch.sort(gather_variable(owners), stable=True).indices
    return gather_variable(features)[order], gather_variable(labels)[order]


def knn_label_maps(features: Tensor, bank: Tensor, labels: Tensor, ks: Sequence[int],
                   temperature: float, chunk_size: int) -> dict[int, Tensor]:
    """Per k, the ``(B, C, h, w)`` class distributions of the patches of a ``(B, D, h, w)``
    feature map: the softmax(similarity / ``temperature``)-weighted mean ``labels`` of their
    k most cosine-similar ``bank`` rows."""
    features = F.normalize(features, dim=1)
    b, _, h, w = features.shape
    queries = features.permute(0, 2, 3, 1).flatten(0, 2)
    k_max = min(max(ks), len(bank))
    out: dict[int, list[Tensor]] = {k: [] for k in ks}
    for chunk in queries.split(chunk_size):
        sims, index = (chunk @ bank.T).topk(k_max, dim=1)
        for k in ks:
            weights = torch.softmax(sims[:, :k] / temperature, dim=1)
            out[k].append((weights[..., None] * labels[index[:, :k]]).sum(dim=1))
    return {k: torch.cat(v).reshape(b, h, w, -1).permute(0, 3, 1, 2) for k, v in out.items()}


class DenseKNNSegmentation(pl.LightningModule):
    """Dense kNN segmentation of a frozen backbone, run with ``validate``.

    Val loader 0 (the data module's bank: training images centre-cropped to ``crop_size``)
    fills the memory bank, loader 1 (the val images) is scored. Logs ``val/miou_k<k>`` for
    each k and ``val/miou`` of the best k (percent); :attr:`results` holds all scores. The
    bank is gathered from every rank (without ``DistributedSampler``'s padding) and the
    confusion matrices summed.

    Args:
        backbone: The checkpoint's backbone class (None: rebuilt from the checkpoint).
        num_classes: Number of classes.
        checkpoint: A pre-training checkpoint (``"random"``: the backbone as constructed).
        checkpoint_prefix: State-dict prefix of the backbone in the checkpoint.
        ks: Numbers of neighbours (CAPI / Hummingbird: 1, 3, 10, 30).
        temperature: Softmax temperature of the neighbours' similarities (Hummingbird: 0.02).
        patches_per_image: Bank patches kept per image, a fixed random subset (None: all).
        chunk_size: Val patches compared with the bank at once (memory vs speed).
    """

    def __init__(self, backbone: nn.Module | None = None, num_classes: int | None = None,
                 checkpoint: str | None = None, checkpoint_prefix: str = DEFAULT_PREFIX,
                 ks: Sequence[int] = (1, 3, 10, 30), temperature: float = 0.02,
                 patches_per_image: int | None = None, chunk_size: int = 4096) -> None:
        super().__init__()
        if num_classes is None or num_classes < 2:
            raise ValueError(f"DenseKNNSegmentation needs num_classes >= 2, got {num_classes}.")
        if not ks or min(ks) < 1 or temperature <= 0:
            raise ValueError(f"ks must be >= 1 and temperature > 0, got {list(ks)} and "
                             f"{temperature}.")
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone, self._checkpoint = frozen_backbone(backbone, checkpoint,
                                                          checkpoint_prefix,
                                                          "DenseKNNSegmentation")
        #: The checkpoint's preprocessing record (None: ``"random"`` or an older checkpoint).
        self.checkpoint_preprocessing = (recorded_preprocessing(self._checkpoint)
                                         if self._checkpoint is not None else None)
        self.num_classes, self.ks, self.temperature = num_classes, sorted(ks), temperature
        self.patches_per_image, self.chunk_size = patches_per_image, chunk_size
        self.matrices = {k: ConfusionMatrix(num_classes, IGNORE_INDEX) for k in self.ks}
        self.results: dict[str, dict[str, Tensor]] = {}
        self._bank: list[Tensor] = []
        self._labels: list[Tensor] = []
        self._owners: list[Tensor] = []
        self._bank_ready: tuple[Tensor, Tensor] | None = None
        self._seen = [0, 0]

    def setup(self, stage: str) -> None:
        """Normalise the data by the checkpoint's recorded statistics unless the data module
        was given its own (warning where they differ), and say which."""
        if self._checkpoint is not None:
            adopt_dense_normalisation("DenseKNNSegmentation", self.checkpoint_preprocessing,
                                      getattr(self.trainer, "datamodule", None),
                                      f"checkpoint {self._checkpoint!r}")

    def train(self, mode: bool = True) -> DenseKNNSegmentation:
        super().train(mode)
        self.backbone.eval()
        return self

    def on_validation_epoch_start(self) -> None:
        self._bank, self._labels, self._owners, self._bank_ready = [], [], [], None
        self._seen = [0, 0]
        for matrix in self.matrices.values():
            matrix.counts.zero_()

    def add_to_bank(self, images: Tensor, masks: Tensor, indices: Sequence[int]) -> None:
        """Add the labelled patches of a bank batch (the images of dataset ``indices``)."""
        feats, dists, owners = bank_patches(patch_features(self.backbone, images), masks,
                                            self.num_classes, self.patches_per_image, indices)
        self._bank.append(feats)
        self._labels.append(dists)
        self._owners.append(owners)

    def bank(self) -> tuple[Tensor, Tensor]:
        """The bank of every rank (a collective; built once per validation)."""
        if self._bank_ready is None:
            device = self.device
            feats = torch.cat(self._bank) if self._bank else torch.zeros(0, 1, device=device)
            labels = torch.cat(self._labels) if self._labels else torch.zeros(
                0, self.num_classes, device=device)
            owners = torch.cat(self._owners) if self._owners else torch.zeros(
                0, dtype=torch.int64, device=device)
            self._bank_ready = gather_bank(feats, labels, owners)
        return self._bank_ready

    def label_maps(self, images: Tensor) -> dict[int, Tensor]:
        """Per k, the ``(B, C, h, w)`` predicted class distributions of the images' patches."""
        bank, labels = self.bank()
        return knn_label_maps(patch_features(self.backbone, images), bank, labels, self.ks,
                              self.temperature, self.chunk_size)

    def validation_step(self, batch: tuple, batch_idx: int, dataloader_idx: int = 0) -> None:
        images, masks = batch[0], batch[1]
        keep = real_samples(self.trainer, dataloader_idx, self._seen[dataloader_idx],
                            len(images), images.device)
        start = self._seen[dataloader_idx]
        self._seen[dataloader_idx] += len(images)
        if dataloader_idx == 0:
            if keep.any():
                indices = dataset_positions(start + len(images),
                                            val_sampler(self.trainer, 0))[start:]
                self.add_to_bank(images[keep], masks[keep], indices[keep.cpu()].tolist())
            return
        maps = self.label_maps(images)  # every rank takes part in the bank's gather
        for k, dist in maps.items():
            if keep.any():
                full = F.interpolate(dist[keep], size=masks.shape[-2:], mode="bilinear",
                                     align_corners=False)
                self.matrices[k].update(full.argmax(dim=1), masks[keep])

    def on_validation_epoch_end(self) -> None:
        self.results = {f"k{k}": m.compute() for k, m in self.matrices.items()}
        for name, scores in self.results.items():
            self.log(f"val/miou_{name}", scores["miou"].float(), sync_dist=True)
        best = max(self.results.values(), key=lambda s: float(torch.nan_to_num(s["miou"], -1)))
        self.log("val/miou", best["miou"].float(), prog_bar=True, sync_dist=True)
        self._bank, self._labels, self._owners, self._bank_ready = [], [], [], None
