"""kNN at several k and temperatures in one pass: every (k, T) equals a float64 reference loop
and the single-pair result; the callback logs every pair with one collective."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from test_knn import _FeaturesAreInputs, _random_problem, _reference_scores
from torch.utils.data import DataLoader, TensorDataset

import ssl_lightning.callbacks.knn as knn_module
from ssl_lightning.callbacks import KNNCallback, knn_predict
from ssl_lightning.callbacks.knn import knn_predict_grid

KS, TEMPERATURES = [1, 3, 10, 60], [0.07, 0.5]


def test_every_pair_equals_the_reference_loop_and_the_single_pair() -> None:
    bank, targets, queries = _random_problem(seed=3, n_bank=40, n_query=13)
    bank, queries = bank.double(), queries.double()
    grid = knn_predict_grid(bank, targets, queries, 5, KS, TEMPERATURES, chunk_size=4)
    assert list(grid) == [(k, t) for k in KS for t in TEMPERATURES]
    for (k, t), scores in grid.items():
        expected = _reference_scores(bank.numpy(), targets.numpy(), queries.numpy(), 5, k, t)
        np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-12, err_msg=f"k={k} T={t}")
        single = knn_predict(bank, targets, queries, 5, k=k, temperature=t, chunk_size=4)
        torch.testing.assert_close(scores, single, rtol=1e-14, atol=0)


def test_callback_logs_every_pair_and_the_default_pair_unchanged() -> None:
    bank, targets, queries = _random_problem(seed=2, n_bank=30, n_query=20, classes=3)
    query_targets = torch.randint(3, (20,), generator=torch.Generator().manual_seed(5))
    loaders = [DataLoader(TensorDataset(bank, targets), batch_size=7),
               DataLoader(TensorDataset(queries, query_targets), batch_size=6)]
    metrics = {}
    for name, callback in (("one", KNNCallback(k=5, temperature=0.2)),
                           ("grid", KNNCallback(k=5, temperature=0.2, ks=[1, 10],
                                                temperatures=[0.05]))):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[callback])
        trainer.validate(_FeaturesAreInputs(), dataloaders=loaders, verbose=False)
        metrics[name] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["one"]["val/knn_top1"] == metrics["grid"]["val/knn_top1"]
    assert metrics["one"]["val/knn_top5"] == metrics["grid"]["val/knn_top5"]
    for k in (5, 1, 10):
        for t in (0.2, 0.05):
            scores = _reference_scores(bank.numpy(), targets.numpy(), queries.numpy(), 3, k, t)
            top1 = 100 * np.mean(np.argmax(scores, axis=1) == query_targets.numpy())
            assert metrics["grid"][f"val/knn_k{k}_t{t:g}_top1"] == pytest.approx(top1), (k, t)
    assert "val/knn_k5_t0.2_top1" not in metrics["one"]


def test_knn_grid_makes_one_collective(monkeypatch) -> None:
    calls = []
    real = knn_module.all_reduce_mean_no_grad
    monkeypatch.setattr(knn_module, "all_reduce_mean_no_grad",
                        lambda x: calls.append(x.shape) or real(x))
    bank, targets, queries = _random_problem(seed=2, n_bank=30, n_query=20, classes=3)
    loaders = [DataLoader(TensorDataset(bank, targets), batch_size=7),
               DataLoader(TensorDataset(queries, targets[:20]), batch_size=6)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[KNNCallback(k=5, ks=[1, 10], temperatures=[0.05])])
    trainer.validate(_FeaturesAreInputs(), dataloaders=loaders, verbose=False)
    assert calls == [torch.Size([13])]  # 6 pairs x (top-1, top-5) + the count


@pytest.mark.parametrize("kwargs, match", [({"ks": [0]}, "k must be >= 1"),
                                           ({"temperatures": [-1.0]}, "temperature")])
def test_bad_grids_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KNNCallback(**kwargs)
