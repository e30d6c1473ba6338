"""Weighted k-nearest-neighbour evaluation of frozen features.

Wu, Xiong, Yu & Lin, "Unsupervised Feature Learning via Non-Parametric Instance Discrimination",
CVPR 2018, §3.4: a query is classified by its k most cosine-similar training features, each
voting for its class with weight ``exp(s / T)``; the class with the largest summed weight wins.
k = 200 and T = 0.07 are the defaults used across the SSL literature (InstDisc, MoCo, solo-learn).
Several k and temperatures (DINOv2's ``eval/knn.py`` reports k = 10, 20, 100, 200) come from one
pass: :func:`knn_predict_grid` computes each similarity block and its top-max(k) once.

:func:`knn_predict` is a pure function (usable for offline evaluation); :class:`KNNCallback`
collects features during validation, gathers them across ranks and logs ``val/knn_top1`` and
``val/knn_top5``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DistributedSampler

from ssl_lightning._lightning import pl
from ssl_lightning.distributed import (
    all_gather_no_grad,
    all_reduce_mean_no_grad,
    is_distributed,
    world_size,
)
from ssl_lightning.losses.numerics import at_least_fp32


def _check_knn_args(k: int, temperature: float, chunk_size: int) -> None:
    if k < 1:
        raise ValueError(f"kNN k must be >= 1, got {k}.")
    if not temperature > 0:
        raise ValueError(f"kNN temperature must be > 0, got {temperature}.")
    if chunk_size < 1:
        raise ValueError(f"kNN chunk_size must be >= 1, got {chunk_size}.")


def _check_knn_grid(ks: Sequence[int], temperatures: Sequence[float], chunk_size: int) -> None:
    if not ks or not temperatures:
        raise ValueError(f"kNN needs at least one k and one temperature, got ks={list(ks)}, "
                         f"temperatures={list(temperatures)}.")
    for k in ks:
        for temperature in temperatures:
            _check_knn_args(k, temperature, chunk_size)


@torch.no_grad()
def knn_predict(
    bank_features: Tensor,
    bank_targets: Tensor,
    query_features: Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.07,
    chunk_size: int = 512,
) -> Tensor:
    """Class scores of a weighted cosine kNN classifier (Wu et al., 2018).

    Features are L2-normalised here (a no-op for normalised inputs). Queries are processed in
    chunks of ``chunk_size``, so the similarity matrix held at once is ``chunk_size × N_bank``
    (50,000 bank features and chunk_size 512 take about 100 MB in fp32).

    Args:
        bank_features: Memory-bank features, (N, D).
        bank_targets: Their labels in ``[0, num_classes)``, (N,).
        query_features: Features to classify, (Q, D).
        num_classes: Number of classes C.
        k: Number of neighbours (clamped to N).
        temperature: T in the vote weight ``exp(cosine / T)``.
        chunk_size: Queries scored at once.

    Returns:
        Scores (Q, C) in fp32 (float64 for float64 features): per class, the summed weights of
        the neighbours of that class.
    """
    return knn_predict_grid(bank_features, bank_targets, query_features, num_classes, [k],
                            [temperature], chunk_size)[(k, temperature)]


@torch.no_grad()
def knn_predict_grid(
    bank_features: Tensor,
    bank_targets: Tensor,
    query_features: Tensor,
    num_classes: int,
    ks: Sequence[int] = (200,),
    temperatures: Sequence[float] = (0.07,),
    chunk_size: int = 512,
) -> dict[tuple[int, float], Tensor]:
    """:func:`knn_predict`'s scores for every (k, temperature) pair, from one pass.

    Each chunk's similarity matrix and its top-``max(ks)`` neighbours (sorted) are computed
    once; each k takes the first k of them and each temperature weighs them.

    Returns:
        ``{(k, temperature): scores (Q, C)}`` (k as given, clamped to N inside).
    """
    _check_knn_grid(ks, temperatures, chunk_size)
    if bank_features.dim() != 2 or query_features.dim() != 2:
        raise ValueError(
            f"kNN expects (N, D) bank and (Q, D) query features, got "
            f"{tuple(bank_features.shape)} and {tuple(query_features.shape)}."
        )
    if bank_features.shape[1] != query_features.shape[1]:
        raise ValueError(
            f"Bank feature size {bank_features.shape[1]} != query feature size "
            f"{query_features.shape[1]}."
        )
    if bank_targets.shape != (bank_features.shape[0],):
        raise ValueError(
            f"bank_targets must have shape ({bank_features.shape[0]},), got "
            f"{tuple(bank_targets.shape)}."
        )
    if bank_targets.numel() == 0:
        raise ValueError("The kNN memory bank is empty.")
    if bank_targets.min() < 0 or bank_targets.max() >= num_classes:
        raise ValueError(
            f"bank_targets must lie in [0, {num_classes}), got values in "
            f"[{int(bank_targets.min())}, {int(bank_targets.max())}]."
        )
    bank = F.normalize(at_least_fp32(bank_features), dim=1)
    bank_targets = bank_targets.long()
    pairs = [(k, t) for k in ks for t in temperatures]
    scores: dict[tuple[int, float], list[Tensor]] = {pair: [] for pair in pairs}
    for queries in query_features.split(chunk_size):
        similarity = F.normalize(at_least_fp32(queries).to(bank.dtype), dim=1) @ bank.T
        top_sim, top_idx = similarity.topk(min(max(ks), bank.shape[0]), dim=1)
        top_labels = bank_targets[top_idx]
        for k, temperature in pairs:
            weights = (top_sim[:, :k] / temperature).exp()
            chunk_scores = torch.zeros(queries.shape[0], num_classes, device=bank.device,
                                       dtype=bank.dtype)
            chunk_scores.scatter_add_(1, top_labels[:, :k], weights)
            scores[(k, temperature)].append(chunk_scores)
    empty = torch.zeros(0, num_classes, device=bank.device, dtype=bank.dtype)
    return {pair: torch.cat(parts) if parts else empty for pair, parts in scores.items()}


def topk_correct(scores: Tensor, targets: Tensor, ks: tuple[int, ...] = (1, 5)) -> list[Tensor]:
    """Number of rows whose target is among the ``k`` highest scores, for each k in ``ks``."""
    top = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices
    hits = top == targets.unsqueeze(1)
    return [hits[:, :k].any(dim=1).sum() for k in ks]


def padding_mask(n_local: int, sampler: object, device: torch.device) -> Tensor:
    """Which of this rank's ``n_local`` samples are real (not ``DistributedSampler`` padding).

    ``DistributedSampler(drop_last=False)`` repeats the first indices so that every rank gets
    the same count; rank r then holds positions ``r, r + W, r + 2W, ...`` of the padded index
    list, and the positions ``>= len(dataset)`` are the duplicates. This holds with and without
    shuffling. For any other sampler every sample is kept.
    """
    keep = torch.ones(n_local, dtype=torch.bool, device=device)
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        positions = sampler.rank + sampler.num_replicas * torch.arange(n_local, device=device)
        keep = positions < len(sampler.dataset)  # type: ignore[arg-type]
    return keep


def gather_variable(x: Tensor) -> Tensor:
    """Concatenate ``x`` (N_r, ...) from all ranks when N_r differs between ranks (no grad)."""
    if not is_distributed():
        return x
    counts = all_gather_no_grad(torch.tensor([x.shape[0]], device=x.device))
    padded = x.new_zeros((int(counts.max()), *x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = all_gather_no_grad(padded)
    return torch.cat([part[:n] for part, n in zip(gathered.split(padded.shape[0]),
                                                   counts.tolist(), strict=True)])


class KNNCallback(pl.Callback):
    """Logs weighted-kNN accuracy of the backbone features at the end of every validation.

    Expects ``validation_step`` to return ``{"features", "targets"}`` (as :class:`SSLMethod`
    does) with dataloader 0 the memory bank (train split, eval transform) and dataloader 1 the
    queries (val split). Features are L2-normalised and kept on their device; samples with
    target -1 are skipped. Under DDP the bank is gathered from all ranks, each rank scores its
    own queries against the whole bank, and the hit counts are reduced, so ``val/knn_top1`` and
    ``val/knn_top5`` (in percent) are the same on every rank. The duplicates that
    ``DistributedSampler`` adds to even out the ranks are dropped (see :func:`padding_mask`),
    so the result equals a single-process evaluation.

    With ``ks`` and/or ``temperatures``, every (k, T) pair is scored from the same similarity
    matrix (:func:`knn_predict_grid`) and logged as ``val/knn_k{k}_t{T}_top1`` / ``_top5``;
    ``val/knn_top1`` stays the pair (``k``, ``temperature``).

    Args:
        k: Number of neighbours (of ``val/knn_top1``).
        temperature: Vote temperature (of ``val/knn_top1``).
        chunk_size: Queries scored at once (bounds memory).
        num_classes: Number of classes; inferred as ``max(bank target) + 1`` when None.
        ks: More numbers of neighbours, e.g. DINOv2's ``[10, 20, 100, 200]``.
        temperatures: More vote temperatures.
    """

    def __init__(
        self,
        k: int = 200,
        temperature: float = 0.07,
        chunk_size: int = 512,
        num_classes: int | None = None,
        ks: list[int] | None = None,
        temperatures: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.ks = list(dict.fromkeys([k, *(ks or [])]))
        self.temperatures = list(dict.fromkeys([temperature, *(temperatures or [])]))
        _check_knn_grid(self.ks, self.temperatures, chunk_size)
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"KNNCallback num_classes must be >= 2, got {num_classes}.")
        self.k, self.temperature, self.chunk_size = k, temperature, chunk_size
        self.num_classes = num_classes
        self._features: dict[int, list[Tensor]] = {0: [], 1: []}
        self._targets: dict[int, list[Tensor]] = {0: [], 1: []}

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if dataloader_idx not in self._features:
            return
        features = F.normalize(outputs["features"].detach().float(), dim=1)
        self._features[dataloader_idx].append(features)
        self._targets[dataloader_idx].append(outputs["targets"].detach().long())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._features[0] or not self._features[1]:
            self._reset()
            return
        bank, bank_targets = self._collect(trainer, 0)
        queries, query_targets = self._collect(trainer, 1)
        self._reset()
        bank, bank_targets = gather_variable(bank), gather_variable(bank_targets)
        labeled = bank_targets >= 0
        bank, bank_targets = bank[labeled], bank_targets[labeled]
        if bank_targets.numel() == 0:
            return
        num_classes = self.num_classes or int(bank_targets.max()) + 1
        labeled = query_targets >= 0
        queries, query_targets = queries[labeled], query_targets[labeled]
        grid = knn_predict_grid(bank, bank_targets, queries, num_classes, self.ks,
                                self.temperatures, self.chunk_size)
        hits = [c for scores in grid.values()
                for c in topk_correct(scores, query_targets.to(scores.device))]
        counts = torch.stack([*hits, torch.tensor(len(query_targets), device=hits[0].device)])
        counts = all_reduce_mean_no_grad(counts.double()) * world_size()  # one collective
        if counts[-1] == 0:
            return
        for i, (k, temperature) in enumerate(grid):
            top1, top5 = (float(100 * c / counts[-1]) for c in counts[2 * i:2 * i + 2])
            if (k, temperature) == (self.k, self.temperature):
                pl_module.log("val/knn_top1", top1, sync_dist=True)
                pl_module.log("val/knn_top5", top5, sync_dist=True)
            if len(grid) > 1:
                pl_module.log(f"val/knn_k{k}_t{temperature:g}_top1", top1, sync_dist=True)
                pl_module.log(f"val/knn_k{k}_t{temperature:g}_top5", top5, sync_dist=True)

    def _collect(self, trainer: pl.Trainer, dataloader_idx: int) -> tuple[Tensor, Tensor]:
        features = torch.cat(self._features[dataloader_idx])
        targets = torch.cat(self._targets[dataloader_idx]).to(features.device)
        keep = padding_mask(len(targets), val_sampler(trainer, dataloader_idx), features.device)
        return features[keep], targets[keep]

    def _reset(self) -> None:
        for idx in self._features:
            self._features[idx].clear()
            self._targets[idx].clear()


def val_sampler(trainer: pl.Trainer, dataloader_idx: int) -> object:
    """The sampler of validation dataloader ``dataloader_idx`` (None when unavailable)."""
    loaders = getattr(trainer, "val_dataloaders", None)
    if loaders is None:
        return None
    if not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    if dataloader_idx >= len(loaders):
        return None
    return getattr(loaders[dataloader_idx], "sampler", None)

