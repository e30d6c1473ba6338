"""The online dense probe (ssl_lightning/evaluation/dense/online.py): the offline dense kNN's
numbers, logged at the end of a pre-training validation, and 2 processes = 1 process."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from dense_utils import make_segmentation_folder
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data.dense_pairs import SegmentationDataModule
from ssl_lightning.evaluation.dense import DenseKNNProbe, DenseKNNSegmentation
from ssl_lightning.evaluation.dense.online import dense_knn_scores

TINY = {"crop_size": 32, "batch_size": 8, "num_workers": 0, "eval_size": None}


@pytest.fixture(scope="module")
def seg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_segmentation_folder(tmp_path_factory.mktemp("online"), train=12, val=4)


def _backbone() -> SmallConvNet:
    torch.manual_seed(0)
    return SmallConvNet(widths=(16, 32)).eval()


def _scores(rank: int, world: int, root: str) -> Tensor:
    data = SegmentationDataModule(root, num_classes=3, **TINY)
    data.setup("validate")
    bank, queries = (loader.dataset for loader in data.val_dataloader())
    scores = dense_knn_scores(_backbone(), bank, queries, 3, [1, 10], patches_per_image=8)
    return torch.stack([scores[k]["miou"] for k in (1, 10)])


def test_online_scores_are_the_offline_probes(seg_root: Path) -> None:
    data = SegmentationDataModule(str(seg_root), num_classes=3, **TINY)
    knn = DenseKNNSegmentation(_backbone(), num_classes=3, checkpoint="random", ks=[1, 10],
                               patches_per_image=8)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.validate(knn, data, verbose=False)
    offline = torch.stack([knn.results[f"k{k}"]["miou"] for k in (1, 10)])
    torch.testing.assert_close(_scores(0, 1, str(seg_root)), offline, rtol=0, atol=1e-9)
    assert float(offline.min()) > 85


class _Pretraining(pl.LightningModule):
    """A stand-in method: a backbone, one trainable step, one validation batch."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _backbone()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.backbone(batch).pow(2).mean()

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.backbone.parameters(), lr=0.0)


def test_the_callback_logs_the_miou_at_the_end_of_validation(seg_root: Path) -> None:
    loader = torch.utils.data.DataLoader(torch.randn(2, 3, 32, 32), batch_size=2)
    probe = DenseKNNProbe(str(seg_root), num_classes=3, ks=[1, 10], crop_size=32,
                          eval_size=None, patches_per_image=8)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[probe], num_sanity_val_steps=0)
    trainer.fit(_Pretraining(), loader, loader)
    expected = _scores(0, 1, str(seg_root))
    for k, value in zip((1, 10), expected.tolist(), strict=True):
        assert abs(float(trainer.callback_metrics[f"val/dense_knn_miou_k{k}"]) - value) < 1e-4


def test_the_callback_names_a_bad_pair_before_training(tmp_path: Path) -> None:
    root = make_segmentation_folder(tmp_path, train=2, val=1)
    (root / "val" / "masks" / "0.png").unlink()
    probe = DenseKNNProbe(str(root), num_classes=3, crop_size=32)
    loader = torch.utils.data.DataLoader(torch.randn(2, 3, 32, 32), batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[probe],
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="val/images/0.png has no"):
        trainer.fit(_Pretraining(), loader)
    assert trainer.global_step == 0


@pytest.mark.slow
def test_two_processes_give_the_scores_of_one(seg_root: Path) -> None:
    from distributed_utils import run_in_processes

    one = _scores(0, 1, str(seg_root))
    for result in run_in_processes(_scores, 2, str(seg_root)):
        torch.testing.assert_close(result, one, rtol=0, atol=1e-9)
