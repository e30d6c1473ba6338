"""Weighted kNN (Wu et al., 2018) against a brute-force reference, and the
KNNCallback's bookkeeping (unlabeled samples, DistributedSampler padding, logged values)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ssl_lightning.callbacks import KNNCallback, knn_predict
from ssl_lightning.callbacks.knn import gather_variable, padding_mask


def _reference_scores(bank, bank_targets, queries, num_classes, k, temperature):
    """Plain loops over numpy arrays: cosine similarity, k largest, vote exp(s / T) per class."""
    bank, queries = np.asarray(bank, dtype=np.float64), np.asarray(queries, dtype=np.float64)
    scores = np.zeros((len(queries), num_classes))
    for q, query in enumerate(queries):
        sims = []
        for i, b in enumerate(bank):
            cos = float(query @ b) / (math.sqrt(query @ query) * math.sqrt(b @ b))
            sims.append((cos, i))
        sims.sort(reverse=True)
        for cos, i in sims[:k]:
            scores[q, int(bank_targets[i])] += math.exp(cos / temperature)
    return scores


def _random_problem(seed: int = 0, n_bank: int = 40, n_query: int = 11, classes: int = 5):
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(n_bank, 6, generator=g)
    targets = torch.randint(classes, (n_bank,), generator=g)
    queries = torch.randn(n_query, 6, generator=g)
    return bank, targets, queries


@pytest.mark.parametrize("k", [1, 7, 40, 200])
def test_knn_predict_matches_brute_force_reference(k: int) -> None:
    bank, targets, queries = _random_problem()
    scores = knn_predict(bank, targets, queries, num_classes=5, k=k, temperature=0.1)
    expected = _reference_scores(bank.numpy(), targets.numpy(), queries.numpy(), 5, k, 0.1)
    np.testing.assert_allclose(scores.numpy(), expected, rtol=2e-5)
    # Every query distributes exactly min(k, N) votes.
    assert ((scores > 0).sum(dim=1) <= min(k, len(bank))).all()


def test_knn_chunked_equals_unchunked_and_is_scale_invariant() -> None:
    """Exactness in float64 (in fp32 the matmul's kernel, which depends on the CPU, moves the
    scores by ~3e-6 relative)."""
    bank, targets, queries = _random_problem(seed=1, n_query=29)
    bank, queries = bank.double(), queries.double()
    full = knn_predict(bank, targets, queries, 5, k=9, chunk_size=1000)
    for chunk in (1, 4, 28):
        chunked = knn_predict(bank, targets, queries, 5, k=9, chunk_size=chunk)
        torch.testing.assert_close(chunked, full, rtol=1e-10, atol=0)
    # Cosine similarity: rescaling features must not change anything.
    torch.testing.assert_close(knn_predict(3 * bank, targets, 0.5 * queries, 5, k=9), full,
                               rtol=1e-10, atol=0)


def test_knn_predict_rejects_bad_arguments() -> None:
    bank, targets, queries = _random_problem()
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        knn_predict(bank, targets, queries, 5, k=0)
    with pytest.raises(ValueError, match="temperature must be > 0, got -1"):
        knn_predict(bank, targets, queries, 5, temperature=-1)
    with pytest.raises(ValueError, match="chunk_size"):
        knn_predict(bank, targets, queries, 5, chunk_size=0)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        knn_predict(bank, targets, queries, 3)
    with pytest.raises(ValueError, match="feature size"):
        knn_predict(bank, targets, queries[:, :4], 5)
    with pytest.raises(ValueError, match="temperature"):
        KNNCallback(temperature=0.0)


def test_padding_mask_drops_exactly_the_distributed_sampler_duplicates() -> None:
    # 7 samples on 3 ranks: padded to 9 with samples 0 and 1 repeated; ranks hold 3 each.
    dataset = list(range(7))
    kept = []
    for rank in range(3):
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=3)
        indices = torch.tensor(list(sampler))
        kept.append(indices[padding_mask(len(indices), sampler, torch.device("cpu"))])
    assert sorted(torch.cat(kept).tolist()) == dataset
    no_pad = DistributedSampler(dataset, num_replicas=3, rank=2, shuffle=False, drop_last=True)
    assert padding_mask(2, no_pad, torch.device("cpu")).all()
    assert padding_mask(5, None, torch.device("cpu")).all()
    # Without a process group the variable-size gather is the identity.
    x = torch.arange(6.0).view(3, 2)
    assert gather_variable(x) is x


class _FeaturesAreInputs(pl.LightningModule):
    """validation_step returns the inputs as features (as SSLMethod returns backbone features)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)

    def validation_step(self, batch, batch_idx, dataloader_idx=0) -> dict[str, Tensor]:
        return {"features": batch[0], "targets": batch[1]}


def test_callback_logs_reference_accuracy_and_skips_unlabeled() -> None:
    bank, targets, queries = _random_problem(seed=2, n_bank=30, n_query=20, classes=3)
    query_targets = torch.randint(3, (20,), generator=torch.Generator().manual_seed(5))
    query_targets[:4] = -1  # unlabeled queries are not scored
    bank_targets = targets.clone()
    bank_targets[-5:] = -1  # unlabeled bank entries do not vote
    loaders = [DataLoader(TensorDataset(bank, bank_targets), batch_size=7),
               DataLoader(TensorDataset(queries, query_targets), batch_size=6)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[KNNCallback(k=5, temperature=0.2)])
    trainer.validate(_FeaturesAreInputs(), dataloaders=loaders, verbose=False)

    labeled_bank = bank_targets >= 0
    scores = _reference_scores(bank[labeled_bank].numpy(), bank_targets[labeled_bank].numpy(),
                               queries[4:].numpy(), 3, 5, 0.2)
    ranked = np.argsort(-scores, axis=1)
    expected_top1 = 100 * np.mean(ranked[:, 0] == query_targets[4:].numpy())
    assert 0 < expected_top1 < 100
    assert trainer.callback_metrics["val/knn_top1"].item() == pytest.approx(expected_top1)
    assert trainer.callback_metrics["val/knn_top5"].item() == pytest.approx(100.0)  # 3 classes
