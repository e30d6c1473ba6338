"""Offline kNN evaluation of a checkpoint's backbone.

``python -m ssl_lightning validate --config configs/knn.yaml --model.checkpoint last.ckpt``

The module only loads and freezes the backbone and returns its features from
``validation_step``; the scoring is :class:`ssl_lightning.callbacks.KNNCallback` (weighted cosine
kNN, Wu et al., CVPR 2018, through :func:`ssl_lightning.callbacks.knn.knn_predict`), which the
module attaches itself, so the offline number is computed by exactly the code that logs
``val/knn_top1`` during pre-training, gathered over ranks and chunked over queries.
"""

from __future__ import annotations

from torch import Tensor, nn

from ssl_lightning._lightning import pl
from ssl_lightning.callbacks.knn import KNNCallback
from ssl_lightning.evaluation.checkpoint import (
    DEFAULT_PREFIX,
    backbone_from_checkpoint,
    resolve_checkpoint,
)
from ssl_lightning.evaluation.linear import first_view
from ssl_lightning.evaluation.preprocessing import check_data_preprocessing, recorded_preprocessing


class KNNEval(pl.LightningModule):
    """Frozen backbone of a checkpoint + the kNN callback, for ``trainer.validate``.

    Needs a data module whose ``val_dataloader`` returns ``[bank_loader, query_loader]`` (all
    ssl_lightning data modules do). Logs ``val/knn_top1`` and ``val/knn_top5`` (percent).

    Args:
        backbone: The backbone the checkpoint was trained with; ``None``: rebuilt from the
            checkpoint's ``backbone_spec``. Given, it overrides the spec.
        checkpoint: Pre-training checkpoint of any ssl_lightning method, or ``"random"`` to
            evaluate the backbone as constructed (the random-init baseline). Required: ``None``
            is refused with a ValueError.
        checkpoint_prefix: State-dict prefix of the backbone in the checkpoint.
        k: Number of neighbours.
        temperature: Vote temperature.
        chunk_size: Queries scored at once: the similarity block is ``chunk_size × N_bank``
            (512 × 50,000 fp32 = 100 MB).
        num_classes: Number of classes; inferred from the bank labels when ``None``.
        ks: More numbers of neighbours scored in the same pass (e.g. DINOv2's
            ``[10, 20, 100, 200]``), logged as ``val/knn_k{k}_t{T}_top1``.
        temperatures: More vote temperatures scored in the same pass.
    """

    def __init__(
        self,
        backbone: nn.Module | None = None,
        checkpoint: str | None = None,
        checkpoint_prefix: str = DEFAULT_PREFIX,
        k: int = 200,
        temperature: float = 0.07,
        chunk_size: int = 512,
        num_classes: int | None = None,
        ks: list[int] | None = None,
        temperatures: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.knn = KNNCallback(k, temperature, chunk_size, num_classes, ks,  # validates them
                               temperatures)
        self.save_hyperparameters(ignore=["backbone"])
        path = resolve_checkpoint(checkpoint, "KNNEval")
        if path is not None:
            backbone = backbone_from_checkpoint(path, backbone, checkpoint_prefix)
        elif backbone is None:
            raise ValueError("KNNEval with checkpoint: random needs a backbone (--model.backbone).")
        self.backbone = backbone.requires_grad_(False).eval()
        self._checkpoint = path
        self.checkpoint_preprocessing = recorded_preprocessing(path) if path is not None else None

    def setup(self, stage: str) -> None:
        """Say which preprocessing the data applies, warning when the checkpoint was fed
        otherwise."""
        if self._checkpoint is not None:
            check_data_preprocessing("KNNEval", self.checkpoint_preprocessing,
                                     getattr(self.trainer, "datamodule", None),
                                     f"checkpoint {self._checkpoint!r}")

    def train(self, mode: bool = True) -> KNNEval:
        """The backbone stays in eval mode."""
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, images: Tensor) -> Tensor:
        """Backbone features."""
        return self.backbone(images)

    def validation_step(
        self, batch: tuple, batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        images, targets = batch
        return {"features": self.backbone(first_view(images)), "targets": targets}

    def configure_callbacks(self) -> list[pl.Callback]:
        return [self.knn]
