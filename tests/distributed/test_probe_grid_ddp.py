"""Probe grids on 2 processes = 1 process holding the global batch (float64, 1e-9): LinearEval's
heads on a ViT's token sources, the online probe's heads on the step's features and on a ViT's
token sources (its own forward of the first view), and its attentive heads in a grid with
pooled and token sources over two depths (tokens kept per rank, gradients summed); the kNN
grid and few-shot metrics of ``validate`` on an odd split (padded by DistributedSampler)."""

from __future__ import annotations

import os
import tempfile

import pytest
import pytorch_lightning as pl
import torch
from distributed_utils import run_in_processes
from torch import Tensor, nn
from torch.utils.data import Subset, TensorDataset

from ssl_lightning.backbones import ViT
from ssl_lightning.callbacks import OnlineProbe
from ssl_lightning.evaluation import FewShotEval, KNNEval, LinearEval
from ssl_lightning.testing.trainer_runs import TensorDataModule, ddp_global_order

pytestmark = pytest.mark.slow

STEPS, BATCH, WORLD, CLASSES = 3, 4, 2, 3
SAMPLES = STEPS * BATCH * WORLD


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    targets = torch.arange(SAMPLES) % CLASSES
    return TensorDataset(torch.randn(SAMPLES, 3, 8, 8, generator=g, dtype=torch.float64), targets)


def _linear_eval() -> LinearEval:
    torch.manual_seed(0)
    vit = ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2)
    return LinearEval(vit, CLASSES, checkpoint="random", lr_scaling="linear",
                      lrs=[0.5, 0.05], weight_decays=[0.0, 0.1], last_blocks=[1, 2],
                      poolings=["cls", "cls+mean"])


class _Features(pl.LightningModule):
    """Its features are the flattened images; a dummy loss on one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def training_step(self, batch: tuple, batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        return {"loss": (self.w**2).sum(), "features": x.flatten(1)[:, :6], "targets": y}

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ViTFeatures(_Features):
    """A frozen ViT backbone whose pooled features the step returns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.backbone = ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2)
        self.backbone.requires_grad_(False)

    def training_step(self, batch: tuple, batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        return {"loss": (self.w**2).sum(), "features": self.backbone(x), "targets": y}

    def validation_step(self, batch: tuple, batch_idx: int, dataloader_idx: int = 0
                        ) -> dict[str, Tensor]:
        return {"features": self.backbone(batch[0]), "targets": batch[1]}


def _fit(devices: int, data: TensorDataset | Subset, batch: int) -> dict[str, dict]:
    """Weights after STEPS steps, and LinearEval's val metrics on an odd split."""
    val = TensorDataset(*(t[:13] for t in _data().tensors))  # padded to 14 on 2 ranks
    out: dict[str, dict] = {}
    for name, model, callbacks in (
            ("linear", _linear_eval(), []),
            ("online", _Features(), [OnlineProbe(CLASSES, 6, lrs=[0.5, 0.05],
                                                 weight_decays=[0.0, 0.1])]),
            ("online_tokens", _ViTFeatures(), [OnlineProbe(
                CLASSES, 8, lrs=[0.5, 0.05], weight_decays=[0.0, 0.1], last_blocks=[1, 2],
                poolings=["cls", "cls+mean"])]),
            ("online_attentive", _ViTFeatures(), [OnlineProbe(
                CLASSES, 8, lrs=[0.05], weight_decays=[0.0, 0.1], last_blocks=[1, 2],
                poolings=["pooled", "cls", "tokens"],  # SGD: a gradient's scale shows
                attentive_num_heads=2)])):
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(
                accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                max_steps=STEPS, precision="64-true", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                default_root_dir=root, callbacks=callbacks)
            trainer.fit(model, datamodule=TensorDataModule(data, batch, [val, val], 5))
        out[f"{name}_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()
                                  if k.startswith("val/")}
        state = (model.state_dict() if name == "linear" else
                 {f"{part}.{k}": v for part in ("linear", "attentive")
                  if getattr(callbacks[0], part) is not None
                  for k, v in getattr(callbacks[0], part).state_dict().items()})
        out[name] = {k: v.detach().clone() for k, v in state.items()}
    return out


def _validate(devices: int) -> dict[str, float]:
    """kNN grid and few-shot metrics on an 11-image val split (padded to 12 on 2 ranks)."""
    g = torch.Generator().manual_seed(1)
    bank = TensorDataset(torch.randn(15, 3, 8, 8, generator=g), torch.arange(15) % CLASSES)
    val = TensorDataset(torch.randn(11, 3, 8, 8, generator=g), torch.arange(11) % CLASSES)
    metrics: dict[str, float] = {}
    for model in (KNNEval(nn.Flatten(), checkpoint="random", k=3, ks=[1, 5],
                          temperatures=[0.1]),
                  FewShotEval(nn.Flatten(), checkpoint="random", shots=[1, 3], draws=3,
                              ks=[1, 2])):
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(
                accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=root)
            trainer.validate(model, datamodule=TensorDataModule(bank, 4, [bank, val], 2),
                             verbose=False)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    return metrics


def _worker(rank: int, world: int) -> tuple[dict[str, dict], dict[str, float]]:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    return _fit(world, _data(), BATCH), _validate(world)


def test_probe_grids_on_two_processes_equal_one_process() -> None:
    ranks = run_in_processes(_worker, WORLD)
    single = _fit(1, Subset(_data(), ddp_global_order(SAMPLES, WORLD, BATCH)), BATCH * WORLD)
    metrics = _validate(1)
    assert len(metrics) == 2 * 6 + 2 + 2 * 2 * 3  # kNN pairs, knn_top1/5, few-shot means/stds
    for _rank, rank_metrics in ranks:
        assert rank_metrics == pytest.approx(metrics, abs=1e-9)
    assert len(single["linear_metrics"]) == 16 + 3  # every head's top-1; the best's 3 metrics
    for rank, _ in ranks:
        assert rank["linear_metrics"] == pytest.approx(single["linear_metrics"], abs=1e-9)
        for key, value in single["linear"].items():
            torch.testing.assert_close(rank["linear"][key], value, rtol=0, atol=1e-9, msg=key)
        for name in ("online", "online_tokens", "online_attentive"):
            assert rank[f"{name}_metrics"] == pytest.approx(single[f"{name}_metrics"], abs=1e-9)
            for key, value in single[name].items():
                torch.testing.assert_close(rank[name][key], value, rtol=0, atol=1e-9, msg=key)
    assert len(single["online_tokens_metrics"]) == 16 + 1  # every head's top-1, the best's
    assert all(v.dtype == torch.float64 and v.abs().sum() > 0
               for v in single["online_tokens"].values())
    # pooled with last_blocks [1, 2]: 5 sources × 2 weight decays, 4 of them attentive heads
    assert len(single["online_attentive_metrics"]) == 10 + 1
    attentive = {k: v for k, v in single["online_attentive"].items() if k.startswith("attentive")}
    assert len({k.split(".")[2] for k in attentive}) == 4
    assert all(v.dtype == torch.float64 for v in attentive.values())
    heads = [v for k, v in single["linear"].items() if k.endswith("weight") and "classifier" in k]
    assert len(heads) == 16 and all(h.abs().sum() > 0 for h in heads)
