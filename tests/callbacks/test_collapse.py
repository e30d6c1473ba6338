"""CollapseMonitor: embedding std and RankMe against references, flags collapse, gathers ranks."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from distributed_utils import run_in_processes
from evaluation_helpers import tiny_trainer
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.callbacks import CollapseMonitor
from ssl_lightning.callbacks.collapse import CollapseWarning, embedding_std, rankme


def ref_embedding_std(z: np.ndarray) -> float:
    """SimSiam §4.1: std over samples of each dimension of z/||z||, averaged over dimensions."""
    zn = z / np.sqrt((z**2).sum(axis=1, keepdims=True))
    stds = [np.std(zn[:, j], ddof=1) for j in range(z.shape[1])]
    return float(np.mean(stds))


def ref_rankme(z: np.ndarray, eps: float = 1e-7) -> float:
    """Garrido et al. 2023, Eq. 1: exp(-sum p_k log p_k), p_k = sigma_k / ||sigma||_1 + eps."""
    sigma = np.linalg.svd(z.astype(np.float64), compute_uv=False)
    p = sigma / sigma.sum() + eps
    return float(math.exp(-sum(pk * math.log(pk) for pk in p)))


def test_metrics_match_paper_formulas():
    z = torch.randn(50, 12, generator=torch.Generator().manual_seed(0)) @ torch.diag(
        torch.linspace(0.1, 3, 12))
    assert embedding_std(z).item() == pytest.approx(ref_embedding_std(z.numpy()), rel=1e-5)
    assert rankme(z).item() == pytest.approx(ref_rankme(z.numpy()), rel=1e-5)


def test_metric_limits():
    d = 16
    equal_spread = torch.eye(d).repeat(4, 1)  # singular values all equal -> rank d
    assert rankme(equal_spread).item() == pytest.approx(d, rel=1e-4)
    line = torch.randn(40, 1) @ torch.randn(1, d)  # rank-1 matrix
    assert rankme(line).item() == pytest.approx(1.0, abs=1e-3)
    constant = torch.ones(40, d)
    assert embedding_std(constant).item() == 0.0
    gaussian = torch.randn(4000, d, generator=torch.Generator().manual_seed(0))
    assert embedding_std(gaussian).item() * math.sqrt(d) == pytest.approx(1.0, abs=0.02)


class FeatureModel(pl.LightningModule):
    """validation_step returns the batch itself as features (a stand-in for a backbone)."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        features, targets = batch
        return {"features": features, "targets": targets}


def validate_with_monitor(features: torch.Tensor) -> tuple[dict, list]:
    targets = torch.zeros(len(features), dtype=torch.long)
    trainer = tiny_trainer(callbacks=[CollapseMonitor()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(FeatureModel(), DataLoader(TensorDataset(features, targets), 32))
    collapse = [w for w in caught if issubclass(w.category, CollapseWarning)]
    return trainer.callback_metrics, collapse


def test_flags_constant_output_model():
    metrics, collapse = validate_with_monitor(torch.full((96, 32), 0.7))
    assert metrics["val/embedding_std"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["val/rankme"] == pytest.approx(1.0, abs=1e-3)
    assert len(collapse) == 1 and "collapse" in str(collapse[0].message)


def test_flags_rank_one_output_with_spread_std():
    """Dimensional collapse: every embedding on one line through the origin (+-v)."""
    signs = torch.where(torch.arange(96) % 2 == 0, 1.0, -1.0)[:, None]
    metrics, collapse = validate_with_monitor(signs * torch.randn(1, 32))
    assert metrics["val/embedding_std"] > 0.5 / math.sqrt(32)
    assert metrics["val/rankme"] == pytest.approx(1.0, abs=1e-3)
    assert len(collapse) == 1


def test_passes_random_feature_model():
    features = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
    metrics, collapse = validate_with_monitor(features)
    assert metrics["val/embedding_std"] * math.sqrt(32) == pytest.approx(1.0, abs=0.1)
    assert metrics["val/rankme"] > 24
    assert collapse == []


def _collect_on_rank(rank: int, world: int, features: torch.Tensor) -> tuple:
    monitor = CollapseMonitor(max_samples=1000)
    trainer = SimpleNamespace(num_val_batches=[1, 1], world_size=world)
    mine = features[rank::world]  # DistributedSampler order; ranks hold 7 and 6 samples
    for i in range(0, len(mine), 4):
        out = {"features": mine[i:i + 4], "targets": torch.zeros(len(mine[i:i + 4]))}
        monitor.on_validation_batch_end(trainer, None, out, None, i, dataloader_idx=1)
        monitor.on_validation_batch_end(trainer, None, {"features": torch.ones(2, 8)}, None, i, 0)
    gathered, _ = monitor.collected()
    return gathered, rankme(gathered).item(), embedding_std(gathered).item()


@pytest.mark.slow
def test_gathers_features_of_all_ranks():
    features = torch.randn(13, 8, generator=torch.Generator().manual_seed(2))
    results = run_in_processes(_collect_on_rank, 2, features)
    expected = torch.cat([features[0::2], features[1::2]])
    for gathered, rank_value, std_value in results:
        assert torch.equal(gathered, expected)
        assert rank_value == pytest.approx(rankme(features).item(), rel=1e-5)
        assert std_value == pytest.approx(embedding_std(features).item(), rel=1e-5)


@pytest.mark.parametrize("kwargs", [{"min_std_ratio": 1.0}, {"min_rankme": 0.5},
                                    {"max_samples": 1}])
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        CollapseMonitor(**kwargs)


def test_sample_cap_takes_a_spread_subset_of_a_class_sorted_loader():
    monitor = CollapseMonitor(max_samples=20)
    trainer = SimpleNamespace(num_val_batches=[1])
    features, targets = torch.randn(100, 4), torch.arange(100) // 25  # sorted by class
    for i in range(0, 100, 10):
        out = {"features": features[i:i + 10], "targets": targets[i:i + 10]}
        monitor.on_validation_batch_end(trainer, None, out, None, i)
    kept, kept_targets = monitor.collected()
    assert len(kept) == 20 and set(kept_targets.tolist()) == {0, 1, 2, 3}
    rows = [int((features == row).all(1).nonzero()) for row in kept]
    assert rows == sorted(set(rows)) and torch.equal(kept_targets, targets[rows])
    assert torch.equal(monitor.collected()[0], kept)  # the same subset every time
