"""2-D pictures (PCA, t-SNE or UMAP) of validation embeddings, coloured by class.

The projections are in :mod:`ssl_lightning.evaluation.projection`. Matplotlib (and scikit-learn
or umap-learn for t-SNE/UMAP: ``pip install ssl_lightning[plots]``) is imported only when a
picture is drawn; a missing one fails at construction.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ssl_lightning._lightning import TensorBoardLogger, pl
from ssl_lightning.callbacks.artifacts import log_run_file
from ssl_lightning.callbacks.features import ValFeatureCollector
from ssl_lightning.evaluation.projection import ProjectionName, check_projection, project_2d
from ssl_lightning.io import atomic_path, run_directory


def plot_embeddings(
    points: Tensor,
    targets: Tensor,
    title: str = "",
    class_names: Sequence[str] | None = None,
    axis_label: str = "PC",
) -> np.ndarray:
    """Scatter plot of 2-D ``points`` coloured by ``targets``; returns the RGB image (H, W, 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5), dpi=90)
    try:
        cmap = plt.get_cmap("tab10" if int(targets.max()) < 10 else "tab20")
        for c in torch.unique(targets).tolist():
            sel = targets == c
            label = class_names[c] if class_names is not None and 0 <= c < len(class_names) else c
            ax.scatter(points[sel, 0], points[sel, 1], s=3, color=cmap(c % cmap.N), label=label)
        ax.set_xlabel(f"{axis_label} 1")
        ax.set_ylabel(f"{axis_label} 2")
        ax.set_title(title, fontsize=9)
        ax.legend(markerscale=3, fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
        fig.tight_layout()
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()  # type: ignore[attr-defined]
    finally:
        plt.close(fig)


_TITLES = {"pca": "PCA", "tsne": "t-SNE", "umap": "UMAP"}


class EmbeddingPlot(ValFeatureCollector):
    """Writes a 2-D picture of the val embeddings at the end of fit and of validate.

    The PNG goes to ``dirpath`` (default: the run's own directory,
    :func:`~ssl_lightning.io.run_directory`) as
    ``embeddings_<stage>_epoch<E>.png`` (``embeddings_<method>_...`` for t-SNE/UMAP), to the
    run's artifacts of an MLflow / W&B logger, and to TensorBoard as the image ``val/embeddings``.

    Args:
        method: ``"pca"`` (default), ``"tsne"`` or ``"umap"``.
        dirpath: Folder of the PNG files; ``None``: the run directory.
        class_names: Legend labels (index -> name); ``None``: class indices.
        dataloader_idx: Val dataloader to draw (``-1``: the last, the val split).
        max_samples: Points drawn.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        class_names: list[str] | None = None,
        dataloader_idx: int = -1,
        max_samples: int = 5000,
        method: ProjectionName = "pca",
    ) -> None:
        super().__init__(dataloader_idx, max_samples)
        check_projection(method)
        self.method = method
        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError(
                "EmbeddingPlot draws with matplotlib, which is not installed: run "
                "`pip install -e \".[plots]\"` (or `pip install matplotlib`), or remove "
                "EmbeddingPlot from trainer.callbacks."
            )
        self.dirpath = dirpath
        self.class_names = class_names
        self._latest: tuple[Tensor, Tensor, int] | None = None
        self.last_path: str | None = None

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        collected = self.collected()
        if collected is None or trainer.sanity_checking:
            return
        features, targets = collected
        if not bool(torch.isfinite(features).all()):  # gathered: the same on every rank
            if trainer.is_global_zero:
                warnings.warn(f"EmbeddingPlot: the validation embeddings at epoch "
                              f"{trainer.current_epoch} contain NaN/inf values; no picture.",
                              stacklevel=2)
            self._latest = None
            return
        self._latest = (project_2d(features, self.method).cpu(), targets.cpu(),
                        trainer.current_epoch)
        if trainer.state.fn is not None and trainer.state.fn.value != "fit":
            self.draw(trainer, trainer.state.fn.value)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.draw(trainer, "fit")

    def draw(self, trainer: pl.Trainer, stage: str) -> None:
        """Write the latest picture (rank 0 only) as PNG, to the tracker's artifacts and to
        TensorBoard loggers.

        Every rank calls this: the run directory is a broadcast under DDP, so it is read on all
        ranks before the non-zero ranks return.
        """
        if self._latest is None:
            return
        run_dir = run_directory(trainer)
        dirpath = self.dirpath or run_dir
        if not trainer.is_global_zero:
            return
        points, targets, epoch = self._latest
        image = plot_embeddings(
            points, targets,
            f"{_TITLES[self.method]} of val embeddings ({stage}, epoch {epoch}, n={len(targets)})",
            self.class_names, _TITLES[self.method].replace("PCA", "PC"),
        )
        kind = "" if self.method == "pca" else f"{self.method}_"
        self.last_path = os.path.join(dirpath, f"embeddings_{kind}{stage}_epoch{epoch:03d}.png")
        from PIL import Image

        with atomic_path(self.last_path) as tmp:
            Image.fromarray(image).save(tmp, format="PNG")
        log_run_file(trainer, self.last_path, run_dir)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(
                    "val/embeddings", image, trainer.global_step, dataformats="HWC"
                )
