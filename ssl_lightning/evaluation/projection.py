"""2-D projections of embeddings for pictures: PCA, t-SNE, UMAP.

- PCA (Pearson, 1901) through an exact SVD: linear, deterministic, no dependency.
- t-SNE (van der Maaten & Hinton, JMLR 2008), scikit-learn's implementation.
- UMAP (McInnes, Healy & Melville, 2018), the umap-learn package.

t-SNE and UMAP come with ``pip install "ssl_lightning[plots]"``. All three work on the
L2-normalised features (the geometry of the kNN evaluation) and are seeded.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

ProjectionName = Literal["pca", "tsne", "umap"]
PROJECTIONS: tuple[str, ...] = ("pca", "tsne", "umap")


def pca_2d(features: Tensor) -> Tensor:
    """Project ``features`` (N, D) on their first two principal components -> (N, 2).

    Features are L2-normalised and centred; each component's sign is fixed so that its largest
    loading is positive.
    """
    x = F.normalize(features.double(), dim=1)
    x = x - x.mean(dim=0)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    components = vh[:2]
    signs = torch.sign(components.gather(1, components.abs().argmax(dim=1, keepdim=True)))
    return (x @ (components * signs).T).float()


def check_projection(method: str) -> None:
    """A ``ValueError`` for an unknown method, an ``ImportError`` with the install command for
    a missing package (so a callback can fail at construction, before training)."""
    if method not in PROJECTIONS:
        raise ValueError(f"Unknown projection {method!r}; choose one of {PROJECTIONS}.")
    module = {"tsne": "sklearn", "umap": "umap"}.get(method)
    if module is not None:
        import importlib.util

        if importlib.util.find_spec(module) is None:
            package = {"sklearn": "scikit-learn", "umap": "umap-learn"}[module]
            raise ImportError(
                f"The {method} projection needs {package}: `pip install \"ssl_lightning[plots]\"`"
                f" (or `pip install {package}`), or use method='pca'."
            )


def project_2d(features: Tensor, method: ProjectionName = "pca", seed: int = 0) -> Tensor:
    """``features`` (N, D) -> (N, 2) points by ``method``."""
    check_projection(method)
    if method == "pca":
        return pca_2d(features)
    x = F.normalize(features.double(), dim=1).cpu().numpy()
    if method == "tsne":
        from sklearn.manifold import TSNE

        perplexity = float(min(30.0, max(1.0, (len(x) - 1) / 3)))
        points = TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(x)
    else:
        import umap

        neighbours = int(min(15, max(2, len(x) - 1)))
        points = umap.UMAP(n_neighbors=neighbours, random_state=seed,
                           n_jobs=1).fit_transform(x)
    return torch.as_tensor(points, dtype=torch.float32)
