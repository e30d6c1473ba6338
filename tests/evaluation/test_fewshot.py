"""FewShotEval: seeded draws of exactly n per class; kNN and logistic regression equal direct
calls (knn_predict, scikit-learn) on the same draws; mean ± std over draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from evaluation_helpers import tiny_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.callbacks import knn_predict
from ssl_lightning.evaluation import FewShotEval
from ssl_lightning.evaluation.fewshot import draw_few_shot

sklearn = pytest.importorskip("sklearn.linear_model")

CLASSES = 3


def test_draws_pick_exactly_n_per_class_reproducibly() -> None:
    targets = torch.arange(40) % CLASSES
    targets[::7] = 2  # unbalanced classes
    for n in (1, 2, 5):
        picks = draw_few_shot(targets, n, seed=4)
        assert torch.bincount(targets[picks], minlength=CLASSES).tolist() == [n] * CLASSES
        assert len(set(picks.tolist())) == n * CLASSES
        assert torch.equal(picks, draw_few_shot(targets, n, seed=4))
    assert not torch.equal(draw_few_shot(targets, 2, seed=4), draw_few_shot(targets, 2, seed=5))
    with pytest.raises(ValueError, match="Class 0 has .* fewer than the 20 shots"):
        draw_few_shot(targets, 20, seed=0)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    targets = torch.arange(n) % CLASSES
    colours = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    images = colours[targets][:, :, None, None] + 1.5 * torch.randn(n, 3, 4, 4, generator=g)
    return TensorDataset(images, targets)


def test_results_equal_direct_knn_and_scikit_learn_calls(capsys: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(48, 6))
    model = FewShotEval(backbone, checkpoint="random", shots=[1, 4], draws=3, seed=10,
                        ks=[1, 3], temperature=0.1, logreg_c=0.5)
    train, val = _data(30, 0), _data(20, 1)
    trainer = tiny_trainer()
    trainer.validate(model, [DataLoader(train, batch_size=7), DataLoader(val, batch_size=6)])
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    with torch.no_grad():
        bank = F.normalize(backbone(train.tensors[0]).double(), dim=1)
        queries = F.normalize(backbone(val.tensors[0]).double(), dim=1)
    bank_targets, query_targets = train.tensors[1], val.tensors[1]
    for n in (1, 4):
        knn = {1: [], 3: []}
        logreg = []
        for seed in (10, 11, 12):
            picked = draw_few_shot(bank_targets, n, seed)
            for k in knn:
                scores = knn_predict(bank[picked], bank_targets[picked], queries, CLASSES, k, 0.1)
                knn[k].append(100 * float((scores.argmax(1) == query_targets).double().mean()))
            clf = sklearn.LogisticRegression(C=0.5, max_iter=1000)
            clf.fit(bank[picked].numpy(), bank_targets[picked].numpy())
            logreg.append(100 * clf.score(queries.numpy(), query_targets.numpy()))
        for name, values in [*((f"knn_k{k}", v) for k, v in knn.items()), ("logreg", logreg)]:
            assert metrics[f"val/fewshot_{n}shot_{name}_top1"] == pytest.approx(
                np.mean(values), abs=1e-4), (n, name)
            assert metrics[f"val/fewshot_{n}shot_{name}_top1_std"] == pytest.approx(
                np.std(values, ddof=1), abs=1e-4), (n, name)
    assert math.isfinite(metrics["val/fewshot_1shot_logreg_top1_std"])
    assert "Few-shot top-1 (%), 3 draws" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, match", [({"shots": [0]}, "shots >= 1"),
                                           ({"draws": 0}, "draws >= 1"),
                                           ({"temperature": 0.0}, "temperature > 0")])
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FewShotEval(nn.Flatten(), checkpoint="random", **kwargs)
