"""LinearEval's grid of heads: one frozen forward, each head exactly as if trained alone.

- one head: today's single probe (a plain ``nn.Linear`` + SGD written out here), bit for bit;
- a grid of heads on a ViT (lrs × weight decays × last blocks × poolings, ``pooled`` with
  ``last_blocks [1, 2]``) in float64: every head equals the same head trained alone;
  known-bad: all heads under one weight decay;
- the token sources equal the ViT's own outputs and a loop over its blocks;
- 2 processes = 1 process (float64).
"""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from evaluation_helpers import tiny_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import ssl_lightning.evaluation.linear as linear_module
from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.callbacks.probe_grid import head_param_groups, probe_grid, source_features
from ssl_lightning.evaluation import LinearEval
from ssl_lightning.optim import build_optimizer, run_schedule, split_decay_groups

CLASSES = 3


def _data(n: int, seed: int, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    targets = torch.arange(n) % CLASSES
    colours = torch.tensor([[1.5, 0, 0], [0, 1.5, 0], [0, 0, 1.5]])
    images = colours[targets][:, :, None, None] + torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(images.to(dtype), targets)


def _vit() -> ViT:
    torch.manual_seed(0)
    return ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2, num_registers=1)


class TodaysProbe(pl.LightningModule):
    """The single linear probe as LinearEval trained it before the grid: ``nn.Linear`` on the
    frozen features, cross-entropy, SGD + momentum with decay on the weight, cosine lr."""

    def __init__(self, backbone: nn.Module, dim: int, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.backbone = backbone.requires_grad_(False).eval()
        self.classifier = nn.Linear(dim, CLASSES)
        nn.init.normal_(self.classifier.weight, std=0.01)
        nn.init.zeros_(self.classifier.bias)
        self.lr, self.weight_decay = lr, weight_decay

    def training_step(self, batch: tuple, batch_idx: int) -> Tensor:
        images, targets = batch
        with torch.no_grad():
            features = self.backbone(images).detach()
        return F.cross_entropy(self.classifier(features).float(), targets)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = build_optimizer("sgd", split_decay_groups([self.classifier], self.weight_decay),
                                    lr=self.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": run_schedule(self.trainer, optimizer, 0.0), "interval": "step"}}


def test_one_head_gives_todays_single_probe_bit_for_bit() -> None:
    train, val = _data(48, 0), _data(21, 1)
    backbone = SmallConvNet((8, 16), norm="group")
    torch.manual_seed(3)
    today = TodaysProbe(copy.deepcopy(backbone), 16, lr=0.5, weight_decay=1e-3)
    torch.manual_seed(3)
    grid = LinearEval(copy.deepcopy(backbone), CLASSES, checkpoint="random", lr=0.5,
                      lr_scaling="none", weight_decay=1e-3)
    assert torch.equal(grid.classifier.heads[0].weight, today.classifier.weight)
    tiny_trainer(max_epochs=2).fit(today, DataLoader(train, batch_size=8))
    trainer = tiny_trainer(max_epochs=2)
    trainer.fit(grid, DataLoader(train, batch_size=8), [DataLoader(val, batch_size=7)])
    assert torch.equal(grid.classifier.heads[0].weight, today.classifier.weight)
    assert torch.equal(grid.classifier.heads[0].bias, today.classifier.bias)
    images, targets = val.tensors
    with torch.no_grad():
        logits = today.classifier(today.backbone(images))
    loss = F.cross_entropy(logits, targets, reduction="none").double().sum() / len(targets)
    top1 = 100 * (logits.argmax(1) == targets).double().sum() / len(targets)
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(float(loss), rel=1e-6)
    assert float(trainer.callback_metrics["val/top1"]) == pytest.approx(float(top1), abs=1e-4)


GRID = dict(lrs=[0.5, 0.05], weight_decays=[0.0, 0.1], last_blocks=[1, 2],
            poolings=["pooled", "cls", "mean", "cls+mean"])  # pooled: its heads come once


def _fit64(model: LinearEval, epochs: int = 2) -> LinearEval:
    train, val = _data(24, 0, torch.float64), _data(12, 1, torch.float64)
    trainer = tiny_trainer(max_epochs=epochs, precision="64-true")
    trainer.fit(model, DataLoader(train, batch_size=8), [DataLoader(val, batch_size=6)])
    return model


def _grid() -> tuple[LinearEval, nn.ModuleList]:
    """The grid and a copy of its initial heads."""
    torch.manual_seed(1)
    grid = LinearEval(_vit(), CLASSES, checkpoint="random", lr_scaling="none", **GRID)
    return grid, copy.deepcopy(grid.classifier.heads)


@pytest.fixture(scope="module")
def alone() -> list[LinearEval]:
    """Each head of the grid trained alone from its initial weights. Shared by the known-bad
    test: its patch changes the optimiser groups of several heads, and one head's groups are
    the same with it or without it."""
    grid, start = _grid()
    trained = []
    for spec, head in zip(grid.specs, start, strict=True):
        single = LinearEval(_vit(), CLASSES, checkpoint="random", lr=spec.lr, lr_scaling="none",
                            weight_decay=spec.weight_decay, last_blocks=[spec.last_blocks],
                            poolings=[spec.pooling])
        single.classifier.heads[0].load_state_dict(head.state_dict())
        trained.append(_fit64(single))
    return trained


def test_every_head_of_a_grid_equals_that_head_trained_alone(alone: list[LinearEval]) -> None:
    grid = _fit64(_grid()[0])
    assert len(grid.specs) == 28
    assert [s.source for s in grid.specs[::4]] == [
        (1, "pooled"), (1, "cls"), (1, "mean"), (1, "cls+mean"), (2, "cls"), (2, "mean"),
        (2, "cls+mean")]
    dims = {tuple(h.weight.shape) for h in grid.classifier.heads}
    assert dims == {(CLASSES, 8), (CLASSES, 16), (CLASSES, 24)}
    for i, single in enumerate(alone):
        torch.testing.assert_close(grid.classifier.heads[i].state_dict(),
                                   single.classifier.heads[0].state_dict(), rtol=0, atol=1e-12,
                                   msg=grid.specs[i].name)
    assert len({float(h.weight.sum()) for h in grid.classifier.heads}) == 28  # all distinct


def test_heads_sharing_one_weight_decay_are_caught(monkeypatch: pytest.MonkeyPatch,
                                                  alone: list[LinearEval]) -> None:
    """Known-bad: the grid's heads all get the first head's weight decay."""
    def shared_decay(specs, heads, lr_scale):  # type: ignore[no-untyped-def]
        groups = head_param_groups(specs, heads, lr_scale)
        return [{**g, "weight_decay": specs[0].weight_decay} if g["weight_decay"] else g
                for g in groups]

    monkeypatch.setattr(linear_module, "head_param_groups", shared_decay)
    grid = _fit64(_grid()[0])
    decayed = [i for i, spec in enumerate(grid.specs) if spec.weight_decay > 0]
    assert decayed
    for i in decayed:
        assert not torch.allclose(grid.classifier.heads[i].weight,
                                  alone[i].classifier.heads[0].weight, rtol=0, atol=1e-6)


def test_best_head_is_what_val_top1_reports(capsys: pytest.CaptureFixture) -> None:
    torch.manual_seed(1)
    model = LinearEval(_vit(), CLASSES, checkpoint="random", lr_scaling="none",
                       lrs=[1e-6, 0.5], poolings=["cls", "cls+mean"])
    train, val = _data(24, 0), _data(12, 1)
    trainer = tiny_trainer(max_epochs=3)
    trainer.fit(model, DataLoader(train, batch_size=8), [DataLoader(val, batch_size=6)])
    metrics = trainer.callback_metrics
    heads = {spec.name: float(metrics[f"val/grid_top1/{spec.name}"]) for spec in model.specs}
    assert len(heads) == 4
    best = max(heads.values())
    assert float(metrics["val/top1"]) == best
    chosen = model.specs[int(model.best_head)].name
    assert heads[chosen] == best
    images, targets = val.tensors
    with torch.no_grad():  # forward gives the chosen head's logits
        top1 = 100 * (model(images).argmax(1) == targets).float().mean()
    assert float(top1) == pytest.approx(best, abs=1e-4)
    out = capsys.readouterr().out
    assert "LinearEval grid (4 heads" in out and f"* {chosen}" in out


def test_token_sources_equal_the_vits_own_outputs() -> None:
    vit = _vit().eval()
    x = torch.randn(2, 3, 8, 8)
    sources = [(1, "cls"), (1, "mean"), (2, "cls"), (2, "cls+mean"), (2, "mean"), (1, "pooled")]
    with torch.no_grad():
        out = source_features(vit, x, sources)
        tokens = vit.forward_tokens(x)
        dense, _ = vit.forward_dense(x, last_blocks=2)
        # block by block, written out: the final norm of each block's output
        t = torch.cat([vit.cls_token + vit.pos_embed[:, :1], vit.register_tokens.expand(1, -1, -1)
                       .expand(1, -1, -1)], dim=1).expand(2, -1, -1)
        t = torch.cat([t, vit.patch_embed(x).flatten(2).transpose(1, 2) + vit.pos_embed[:, 1:]], 1)
        first = vit.norm(vit.blocks[0](t))
    torch.testing.assert_close(out[(1, "cls")], tokens[:, 0])
    torch.testing.assert_close(out[(1, "pooled")], vit(x))
    torch.testing.assert_close(out[(1, "mean")], tokens[:, 2:].mean(1))
    torch.testing.assert_close(out[(2, "mean")], dense.mean(dim=(2, 3)))
    torch.testing.assert_close(out[(2, "cls")], torch.cat([first[:, 0], tokens[:, 0]], 1))
    torch.testing.assert_close(out[(2, "cls+mean")],
                               torch.cat([first[:, 0], tokens[:, 0], tokens[:, 2:].mean(1)], 1))


@pytest.mark.parametrize("kwargs, match", [
    ({"poolings": ["cls"]}, "needs a token backbone"),
    ({"poolings": ["max"]}, "Unknown pooling"),
    ({"lrs": [0.1, 0.1]}, "duplicates"),
    ({"lrs": [0.1, -1.0]}, "learning rate"),
    ({"last_blocks": [1, 4]}, "the only pooling is 'pooled'"),
    ({"finetune": True, "lrs": [0.1, 0.2]}, "finetune=True .* one head"),
])
def test_invalid_grids_are_refused_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LinearEval(SmallConvNet((8,)), CLASSES, checkpoint="random", **kwargs)


def test_too_many_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="last_blocks 3 > the backbone's 2 blocks"):
        LinearEval(_vit(), CLASSES, checkpoint="random", last_blocks=[3], poolings=["cls"])


def test_grid_order_and_names() -> None:
    specs = probe_grid([0.1, 0.01], [0.0], [1, 4], ["cls", "cls+mean"])
    assert [s.name for s in specs][:3] == ["blocks1_cls_lr0.1_wd0", "blocks1_cls_lr0.01_wd0",
                                           "blocks1_cls+mean_lr0.1_wd0"]
    assert len(specs) == 8


def test_a_checkpoint_from_before_the_grid_resumes(tmp_path) -> None:
    """Its classifier was one nn.Linear (classifier.weight / .bias, no best_head)."""
    model = LinearEval(SmallConvNet((8, 16), norm="group"), CLASSES, checkpoint="random",
                       lr_scaling="none")
    trainer = tiny_trainer(max_epochs=1)
    trainer.fit(model, DataLoader(_data(16, 0), batch_size=8))
    path = str(tmp_path / "old.ckpt")
    trainer.save_checkpoint(path)
    old = torch.load(path, weights_only=True)
    state = old["state_dict"]
    for name in ("weight", "bias"):
        state[f"classifier.{name}"] = state.pop(f"classifier.heads.0.{name}")
    del state["best_head"]
    torch.save(old, path)
    resumed = LinearEval(SmallConvNet((8, 16), norm="group"), CLASSES, checkpoint="random",
                         lr_scaling="none")
    trainer = tiny_trainer(max_epochs=2)
    trainer.fit(resumed, DataLoader(_data(16, 0), batch_size=8), ckpt_path=path)
    assert trainer.global_step == 4


def test_token_sources_of_a_timm_vit() -> None:
    pytest.importorskip("timm")
    from ssl_lightning.backbones import TimmBackbone

    torch.manual_seed(0)
    backbone = TimmBackbone("vit_tiny_patch16_224", model_kwargs={
        "img_size": 32, "depth": 2, "embed_dim": 16, "num_heads": 2, "reg_tokens": 1}).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = source_features(backbone, x, [(2, "cls+mean"), (1, "tokens")])
        tokens = backbone.net.forward_features(x)  # final-norm tokens: [CLS], register, patches
        inner = backbone.net.get_intermediate_layers(x, n=2, return_prefix_tokens=True, norm=True)
    torch.testing.assert_close(out[(1, "tokens")], tokens[:, 2:])
    torch.testing.assert_close(out[(2, "cls+mean")], torch.cat(
        [inner[0][1][:, 0], tokens[:, 0], tokens[:, 2:].mean(1)], dim=1))
    model = LinearEval(backbone, CLASSES, checkpoint="random", last_blocks=[2],
                       poolings=["cls+mean"])
    assert model.classifier.heads[0].in_features == 48
