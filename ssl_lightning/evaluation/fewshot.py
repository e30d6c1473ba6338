"""Few-shot evaluation: n labelled images per class, several seeded draws, kNN and logistic
regression on frozen features extracted once.

``python -m ssl_lightning validate --config configs/fewshot.yaml --model.checkpoint last.ckpt``

The protocol of DINOv2's ``filter_train(n_per_class)`` low-shot runs (Oquab et al., TMLR 2024)
and VISSL's low-shot benchmark (a linear classifier on n images per class, several draws,
mean ± std): for each n in ``shots`` and each of ``draws`` seeded draws, exactly n training
images per class are picked (:func:`draw_few_shot`); a weighted cosine kNN over them
(:func:`~ssl_lightning.callbacks.knn.knn_predict_grid`) and scikit-learn's
``LogisticRegression`` on their L2-normalised features classify the whole val split. The
features of the train and val splits are extracted once, gathered over ranks and put back in
dataset order, so every rank (and a single process) draws the same images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from ssl_lightning._lightning import pl
from ssl_lightning.callbacks.knn import gather_variable, knn_predict_grid, val_sampler
from ssl_lightning.evaluation.checkpoint import (
    DEFAULT_PREFIX,
    backbone_from_checkpoint,
    resolve_checkpoint,
)
from ssl_lightning.evaluation.linear import first_view


def draw_few_shot(targets: Tensor, shots: int, seed: int) -> Tensor:
    """Sorted indices of exactly ``shots`` samples of every class in ``targets``, drawn
    uniformly from ``seed`` (a CPU generator: the same on every machine and rank).

    Raises:
        ValueError: a class has fewer than ``shots`` samples.
    """
    targets = targets.cpu()
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed))
    picks = []
    for c in targets.unique().tolist():
        members = order[targets[order] == c][:shots]
        if len(members) < shots:
            raise ValueError(f"Class {c} has {len(members)} training samples, fewer than the "
                             f"{shots} shots asked for: lower --model.shots.")
        picks.append(members)
    return torch.cat(picks).sort().values


def dataset_positions(n_local: int, sampler: object) -> Tensor:
    """The dataset index of each of this rank's ``n_local`` val samples (an unshuffled
    ``DistributedSampler``: rank r holds r, r + W, ...; positions past the end are padding)."""
    if isinstance(sampler, DistributedSampler):
        return sampler.rank + sampler.num_replicas * torch.arange(n_local)
    return torch.arange(n_local)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def logistic_regression_top1(train: Tensor, train_targets: Tensor, queries: Tensor,
                             query_targets: Tensor, c: float, max_iter: int) -> float:
    """Top-1 (percent) of scikit-learn's ``LogisticRegression(C=c)`` fit on ``train``."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=c, max_iter=max_iter)
    model.fit(train.double().cpu().numpy(), train_targets.cpu().numpy())
    return 100 * float(model.score(queries.double().cpu().numpy(), query_targets.cpu().numpy()))


class FewShotEval(pl.LightningModule):
    """Frozen backbone of a checkpoint, scored by few-shot kNN and logistic regression.

    Needs a data module whose ``val_dataloader`` returns ``[train_loader, val_loader]`` (all
    ssl_lightning data modules do; set ``knn_train_subset: null`` so the train split is whole).
    Logs, for each n in ``shots``, ``val/fewshot_{n}shot_logreg_top1`` and, for each k,
    ``val/fewshot_{n}shot_knn_k{k}_top1``: the mean over the draws, with ``..._std`` the
    sample standard deviation; prints the table at the end.

    Args:
        backbone: The backbone the checkpoint was trained with; ``None``: rebuilt from the
            checkpoint's ``backbone_spec``.
        checkpoint: Pre-training checkpoint, or ``"random"`` (the backbone as constructed).
        checkpoint_prefix: State-dict prefix of the backbone in the checkpoint.
        shots: Labelled images per class (e.g. 1, 2, 5, 10).
        draws: Seeded draws per n (the seeds ``seed``, ``seed + 1``, ...).
        seed: The first draw's seed.
        ks: Neighbours of the few-shot kNN (clamped to the n·classes labelled images).
        temperature: kNN vote temperature.
        logreg_c: Inverse L2 strength ``C`` of the logistic regression.
        logreg_max_iter: Iterations of its L-BFGS solver.
        chunk_size: kNN queries scored at once.
    """

    def __init__(
        self,
        backbone: nn.Module | None = None,
        checkpoint: str | None = None,
        checkpoint_prefix: str = DEFAULT_PREFIX,
        shots: list[int] | None = None,
        draws: int = 5,
        seed: int = 0,
        ks: list[int] | None = None,
        temperature: float = 0.07,
        logreg_c: float = 1.0,
        logreg_max_iter: int = 1000,
        chunk_size: int = 512,
    ) -> None:
        super().__init__()
        self.shots = list(shots or [1, 2, 5, 10])
        self.ks = list(ks or [10, 20])
        if any(n < 1 for n in self.shots) or draws < 1:
            raise ValueError(f"FewShotEval needs shots >= 1 and draws >= 1, got shots="
                             f"{self.shots}, draws={draws}.")
        if any(k < 1 for k in self.ks) or not temperature > 0 or not logreg_c > 0:
            raise ValueError(f"FewShotEval needs ks >= 1, temperature > 0 and logreg_c > 0, got"
                             f" ks={self.ks}, temperature={temperature}, logreg_c={logreg_c}.")
        try:
            import sklearn  # noqa: F401
        except ImportError as err:
            raise ImportError("FewShotEval's logistic regression needs scikit-learn: pip install "
                              "'ssl_lightning[fewshot]'.") from err
        self.save_hyperparameters(ignore=["backbone"])
        path = resolve_checkpoint(checkpoint, "FewShotEval")
        if path is not None:
            backbone = backbone_from_checkpoint(path, backbone, checkpoint_prefix)
        elif backbone is None:
            raise ValueError("FewShotEval with checkpoint: random needs a backbone "
                             "(--model.backbone).")
        self.backbone = backbone.requires_grad_(False).eval()
        self.draws, self.seed, self.temperature = draws, seed, temperature
        self.chunk_size = chunk_size
        self.logreg_c, self.logreg_max_iter = logreg_c, logreg_max_iter
        self.results: dict[str, tuple[float, float]] = {}
        self._rows: dict[int, list[Tensor]] = {0: [], 1: []}

    def train(self, mode: bool = True) -> FewShotEval:
        """The backbone stays in eval mode."""
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, images: Tensor) -> Tensor:
        """Backbone features."""
        return self.backbone(images)

    def on_validation_epoch_start(self) -> None:
        self._rows = {0: [], 1: []}

    def validation_step(self, batch: tuple, batch_idx: int, dataloader_idx: int = 0
                        ) -> dict[str, Tensor]:
        images, targets = batch[0], batch[1]
        features = self.backbone(first_view(images))
        if dataloader_idx in self._rows:
            self._rows[dataloader_idx].append(torch.cat(
                [F.normalize(features.double(), dim=1), targets.double()[:, None]], dim=1))
        return {"features": features, "targets": targets}

    def _collect(self, dataloader_idx: int) -> tuple[Tensor, Tensor]:
        """This split's features and targets from all ranks, in dataset order, unpadded."""
        rows = torch.cat(self._rows[dataloader_idx])
        sampler = val_sampler(self.trainer, dataloader_idx)
        positions = dataset_positions(len(rows), sampler).to(rows)
        rows = gather_variable(torch.cat([positions[:, None], rows], dim=1))
        rows = rows[rows[:, 0].argsort()]
        if isinstance(sampler, DistributedSampler):
            rows = rows[:len(sampler.dataset)]  # type: ignore[arg-type]  # padding removed
        return rows[:, 1:-1], rows[:, -1].long()

    def on_validation_epoch_end(self) -> None:
        if not self._rows[0] or not self._rows[1]:
            return
        bank, bank_targets = self._collect(0)
        queries, query_targets = self._collect(1)
        self._rows = {0: [], 1: []}
        keep = bank_targets >= 0
        bank, bank_targets = bank[keep], bank_targets[keep]
        keep = query_targets >= 0
        queries, query_targets = queries[keep], query_targets[keep]
        num_classes = int(max(bank_targets.max(), query_targets.max())) + 1
        self.results = self.score(bank, bank_targets, queries, query_targets, num_classes)
        for name, (mean, std) in self.results.items():
            self.log(f"val/fewshot_{name}_top1", mean, sync_dist=True)
            self.log(f"val/fewshot_{name}_top1_std", std, sync_dist=True)

    def score(self, bank: Tensor, bank_targets: Tensor, queries: Tensor, query_targets: Tensor,
              num_classes: int) -> dict[str, tuple[float, float]]:
        """``{"{n}shot_knn_k{k}" | "{n}shot_logreg": (mean top-1, std)}`` over the draws."""
        runs: dict[str, list[float]] = {}
        for n in self.shots:
            for draw in range(self.draws):
                picked = draw_few_shot(bank_targets, n, self.seed + draw).to(bank.device)
                train, train_targets = bank[picked], bank_targets[picked]
                grid = knn_predict_grid(train, train_targets, queries, num_classes, self.ks,
                                        [self.temperature], self.chunk_size)
                for (k, _), scores in grid.items():
                    top1 = 100 * float((scores.argmax(1) == query_targets).double().mean())
                    runs.setdefault(f"{n}shot_knn_k{k}", []).append(top1)
                runs.setdefault(f"{n}shot_logreg", []).append(logistic_regression_top1(
                    train, train_targets, queries, query_targets, self.logreg_c,
                    self.logreg_max_iter))
        return {name: mean_std(values) for name, values in runs.items()}

    def on_validation_end(self) -> None:
        """Print the table of mean ± std (rank 0)."""
        if self.results and self.trainer.is_global_zero:
            width = max(len(name) for name in self.results)
            rows = [f"  {name:<{width}}  {mean:6.2f} ± {std:5.2f}"
                    for name, (mean, std) in self.results.items()]
            print(f"Few-shot top-1 (%), {self.draws} draws:\n" + "\n".join(rows),
                  flush=True)
