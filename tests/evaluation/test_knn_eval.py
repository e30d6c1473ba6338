"""Offline kNN (KNNEval): equals a plain-loop reference and the KNNCallback; chunking is exact."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from evaluation_helpers import simclr_checkpoint, tiny_trainer
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.backbones import ResNet, SmallConvNet
from ssl_lightning.callbacks.knn import KNNCallback, knn_predict
from ssl_lightning.evaluation import EmbeddingPlot, KNNEval

ROOT = Path(__file__).resolve().parents[2]
NUM_CLASSES, K, T = 8, 20, 0.1


def coloured(n: int, seed: int) -> TensorDataset:
    """Class-coloured noisy 8 px images: a kNN accuracy strictly between 0 and 100 %."""
    colours = torch.randn(NUM_CLASSES, 3, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    targets = torch.arange(n) % NUM_CLASSES
    return TensorDataset(colours[targets][:, :, None, None] + torch.randn(n, 3, 8, 8, generator=g),
                         targets)


def ref_knn_accuracy(bank: np.ndarray, bank_y: np.ndarray, queries: np.ndarray,
                     query_y: np.ndarray) -> tuple[float, float]:
    """Wu et al. 2018 weighted kNN, one query at a time: top-1 / top-5 accuracy in percent."""
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    hits1 = hits5 = 0
    for q, y in zip(queries, query_y, strict=True):
        sims = bank @ (q / np.linalg.norm(q))
        votes = np.zeros(NUM_CLASSES)
        for i in np.argsort(-sims)[:K]:
            votes[bank_y[i]] += math.exp(sims[i] / T)
        ranking = np.argsort(-votes)
        assert votes[ranking[4]] > votes[ranking[5]]  # no tie decides the top-5
        hits1 += ranking[0] == y
        hits5 += y in ranking[:5]
    return 100 * hits1 / len(query_y), 100 * hits5 / len(query_y)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("knn") / "simclr.ckpt")
    return path, simclr_checkpoint(SmallConvNet((8, 16), norm="group"), path)


def loaders() -> list[DataLoader]:
    return [DataLoader(coloured(48, 1), batch_size=16), DataLoader(coloured(24, 2), batch_size=16)]


def knn_eval_metrics(path: str, chunk_size: int) -> dict:
    model = KNNEval(SmallConvNet((8, 16), norm="group"), path, k=K, temperature=T,
                    chunk_size=chunk_size, num_classes=NUM_CLASSES)
    trainer = tiny_trainer()
    trainer.validate(model, loaders())
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_offline_knn_equals_reference_and_the_training_callback(checkpoint):
    path, simclr = checkpoint
    offline = knn_eval_metrics(path, chunk_size=512)

    bank, queries = coloured(48, 1).tensors, coloured(24, 2).tensors
    with torch.no_grad():
        features = [simclr.backbone.eval()(x).numpy() for x in (bank[0], queries[0])]
    top1, top5 = ref_knn_accuracy(features[0], bank[1].numpy(), features[1], queries[1].numpy())
    assert 0 < top1 < top5 < 100
    assert offline["val/knn_top1"] == pytest.approx(top1, rel=1e-6)
    assert offline["val/knn_top5"] == pytest.approx(top5, rel=1e-6)

    # the number the KNNCallback logs for the pre-training module on the same data
    trainer = tiny_trainer(callbacks=[KNNCallback(K, T, num_classes=NUM_CLASSES)])
    trainer.validate(simclr, loaders())
    assert float(trainer.callback_metrics["val/knn_top1"]) == offline["val/knn_top1"]
    assert float(trainer.callback_metrics["val/knn_top5"]) == offline["val/knn_top5"]


def test_chunked_equals_unchunked(checkpoint):
    path, _ = checkpoint
    assert knn_eval_metrics(path, chunk_size=1) == knn_eval_metrics(path, chunk_size=10_000)
    g = torch.Generator().manual_seed(3)
    bank, queries = torch.randn(300, 16, generator=g), torch.randn(70, 16, generator=g)
    labels = torch.randint(NUM_CLASSES, (300,), generator=g)
    full = knn_predict(bank, labels, queries, NUM_CLASSES, k=20, chunk_size=70)
    chunked = knn_predict(bank, labels, queries, NUM_CLASSES, k=20, chunk_size=8)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=0)  # fp32 matmul blocking
    assert torch.equal(chunked.argmax(1), full.argmax(1))


def test_backbone_stays_frozen_and_errors_are_those_of_the_loader(checkpoint, tmp_path):
    path, simclr = checkpoint
    model = KNNEval(SmallConvNet((8, 16), norm="group"), path).train()
    assert not model.backbone.training
    assert not any(p.requires_grad for p in model.backbone.parameters())
    with pytest.raises(ValueError, match="shape mismatch"):
        KNNEval(SmallConvNet((8, 24), norm="group"), path)
    with pytest.raises(FileNotFoundError):
        KNNEval(SmallConvNet((8, 16)), str(tmp_path / "nope.ckpt"))
    with pytest.raises(ValueError, match="k must be"):
        KNNEval(SmallConvNet((8, 16)), k=0)


def test_knn_config_runs_through_the_cli_validate(run_config, tmp_path):
    backbone = ResNet(18, cifar_stem=True)
    path = str(tmp_path / "pretrain.ckpt")
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in backbone.state_dict().items()},
                "backbone_spec": backbone.backbone_spec}, path)  # what SSLMethod writes
    cli = run_config(ROOT / "configs" / "knn.yaml", ["--model.checkpoint", path],
                     subcommand="validate")
    assert isinstance(cli.model, KNNEval)
    for key, value in backbone.state_dict().items():
        assert torch.equal(cli.model.backbone.state_dict()[key], value), key
    metrics = cli.trainer.callback_metrics
    assert {"val/knn_top1", "val/knn_top5", "val/embedding_std", "val/rankme"} <= set(metrics)
    assert 0.0 <= float(metrics["val/knn_top1"]) <= 100.0
    (plot,) = [c for c in cli.trainer.callbacks if isinstance(c, EmbeddingPlot)]
    assert plot.last_path is not None and os.path.isfile(plot.last_path)
