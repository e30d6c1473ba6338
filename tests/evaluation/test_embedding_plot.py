"""PCA pictures: PCA against an eigen-decomposition reference; PNG + TensorBoard image written."""

from __future__ import annotations

import os

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from evaluation_helpers import tiny_trainer
from PIL import Image
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.evaluation import EmbeddingPlot, pca_2d, project_2d

pytestmark = pytest.mark.slow

pytest.importorskip("matplotlib")


def test_pca_matches_covariance_eigenvectors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g) @ torch.randn(6, 6, generator=g) + 3.0
    points = pca_2d(x).double().numpy()
    xn = x.double().numpy()
    xn = xn / np.linalg.norm(xn, axis=1, keepdims=True)
    xc = xn - xn.mean(axis=0)
    eigval, eigvec = np.linalg.eigh(xc.T @ xc / (len(xc) - 1))
    for j in range(2):  # component j = eigenvector of the (j+1)-th largest eigenvalue
        ref = xc @ eigvec[:, -1 - j]
        assert np.var(points[:, j], ddof=1) == pytest.approx(eigval[-1 - j], rel=1e-4)
        assert abs(np.corrcoef(points[:, j], ref)[0, 1]) == pytest.approx(1.0, abs=1e-6)


def test_pca_is_deterministic_under_row_permutation():
    x = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(pca_2d(x)[perm], pca_2d(x[perm]), atol=1e-5, rtol=0)


class FeatureModel(pl.LightningModule):
    """Features = the input vectors; one trainable parameter so that fit runs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.w * batch[0].sum()) ** 2

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return {"features": batch[0], "targets": batch[1]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def clustered(n: int = 60) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    targets = torch.arange(n) % 3
    centres = torch.randn(3, 16, generator=g) * 3
    return TensorDataset(centres[targets] + torch.randn(n, 16, generator=g), targets)


def tensorboard_images(log_dir: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"images": 0})
    acc.Reload()
    return acc.Images("val/embeddings") if "val/embeddings" in acc.Tags()["images"] else []


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_writes_png_and_tensorboard_image(tmp_path, stage):
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    plot = EmbeddingPlot(class_names=["a", "b", "c"])
    trainer = tiny_trainer(logger=logger, callbacks=[plot], max_epochs=2)
    data = clustered()
    loaders = (DataLoader(data, 20), [DataLoader(data, 20), DataLoader(data, 20)])
    if stage == "fit":
        trainer.fit(FeatureModel(), *loaders)
        expected = "embeddings_fit_epoch001.png"
    else:
        trainer.validate(FeatureModel(), loaders[1])
        expected = "embeddings_validate_epoch000.png"
    assert plot.last_path == os.path.join(logger.log_dir, expected)
    image = np.asarray(Image.open(plot.last_path))
    assert image.ndim == 3 and image.shape[0] > 200 and image.std() > 0
    assert os.path.getsize(plot.last_path) < 200_000
    events = tensorboard_images(logger.log_dir)
    assert len(events) == 1 and events[0].height == image.shape[0]


def test_missing_matplotlib_is_reported_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match=r"\[plots\]"):
        EmbeddingPlot()


@pytest.mark.parametrize("method", ["tsne", "umap"])
def test_tsne_and_umap_pictures_are_written_and_separate_clusters(tmp_path, method):
    pytest.importorskip({"tsne": "sklearn", "umap": "umap"}[method])
    data = clustered(90)
    features, targets = data.tensors
    points = project_2d(features, method)
    assert points.shape == (90, 2) and torch.isfinite(points).all()
    # well-separated clusters stay separated: each point's nearest neighbour is of its class
    nearest = torch.cdist(points, points).fill_diagonal_(float("inf")).argmin(dim=1)
    assert (targets[nearest] == targets).float().mean() > 0.95
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    plot = EmbeddingPlot(method=method)
    trainer = tiny_trainer(logger=logger, callbacks=[plot], max_epochs=1)
    trainer.validate(FeatureModel(), [DataLoader(data, 30), DataLoader(data, 30)])
    assert plot.last_path == os.path.join(logger.log_dir,
                                          f"embeddings_{method}_validate_epoch000.png")
    assert np.asarray(Image.open(plot.last_path)).std() > 0


def test_unknown_projection_and_missing_package_fail_at_construction(monkeypatch):
    import importlib.util

    with pytest.raises(ValueError, match="Unknown projection 'tsn'"):
        EmbeddingPlot(method="tsn")  # type: ignore[arg-type]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "umap" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="umap-learn"):
        EmbeddingPlot(method="umap")
