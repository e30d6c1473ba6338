"""OnlineProbe: learns a linearly separable problem from the step outputs, matches a hand-run
SGD on the same batches, skips unlabeled samples, and its state round-trips."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.callbacks import OnlineProbe

DIM, CLASSES = 4, 3


class _FeatureModule(pl.LightningModule):
    """Its 'backbone features' are the inputs; the SSL loss is a dummy on one parameter."""

    feature_dim = DIM

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx) -> dict[str, Tensor]:
        x, y = batch
        return {"loss": (self.w**2).sum(), "features": x, "targets": y}

    def validation_step(self, batch, batch_idx, dataloader_idx=0) -> dict[str, Tensor]:
        return {"features": batch[0], "targets": batch[1]}

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _separable(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(CLASSES, (n,), generator=g)
    x = torch.randn(n, DIM, generator=g) * 0.3
    x[torch.arange(n), y] += 3.0  # class c lives around 3 e_c
    return x, y


def _trainer(probe: OnlineProbe, epochs: int, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(**{**dict(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0,
                                callbacks=[probe]), **kwargs})


def test_probe_learns_separable_problem_and_logs_val_top1() -> None:
    x, y = _separable(64, 0)
    train = DataLoader(TensorDataset(x, y), batch_size=16)
    xv, yv = _separable(30, 1)
    val = [DataLoader(TensorDataset(xv, yv), batch_size=8)] * 2
    probe = OnlineProbe(num_classes=CLASSES, lr=0.1)
    trainer = _trainer(probe, epochs=4)
    trainer.fit(_FeatureModule(), train_dataloaders=train, val_dataloaders=val)
    assert trainer.callback_metrics["val/probe_top1"].item() == 100.0
    assert trainer.callback_metrics["train/probe_acc_epoch"].item() == 1.0
    assert probe.linear is not None and probe.linear.heads[0].weight.grad is not None


def test_probe_update_equals_hand_run_sgd_and_skips_unlabeled() -> None:
    x, y = _separable(24, 2)
    y[::5] = -1
    probe = OnlineProbe(num_classes=CLASSES, lr=0.05, momentum=0.9, weight_decay=1e-3)
    trainer = _trainer(probe, epochs=1)
    trainer.fit(_FeatureModule(), train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=8))

    reference = nn.Linear(DIM, CLASSES)
    nn.init.zeros_(reference.weight)
    nn.init.zeros_(reference.bias)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for xb, yb in zip(x.split(8), y.split(8), strict=True):
        keep = yb >= 0
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(xb[keep]), yb[keep]).backward()
        optimizer.step()
    torch.testing.assert_close(probe.linear.heads[0].weight, reference.weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(probe.linear.heads[0].bias, reference.bias, rtol=0, atol=1e-7)


def test_probe_state_round_trips_including_optimizer_momentum() -> None:
    x, y = _separable(32, 3)
    probe = OnlineProbe(num_classes=CLASSES)
    _trainer(probe, epochs=1).fit(_FeatureModule(),
                                  train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=8))
    state = probe.state_dict()
    assert state["optimizer"]["state"], "momentum buffers must be in the checkpoint"
    fresh = OnlineProbe(num_classes=CLASSES)
    fresh.setup(None, _FeatureModule(), "fit")  # type: ignore[arg-type]
    fresh.load_state_dict(state)
    restored = fresh.state_dict()
    torch.testing.assert_close(restored["linear"], state["linear"], rtol=0, atol=0)
    torch.testing.assert_close(restored["optimizer"]["state"], state["optimizer"]["state"],
                               rtol=0, atol=0)
    fresh._ready(_FeatureModule())  # applies the pending state to the live modules
    torch.testing.assert_close(fresh.linear.state_dict(), state["linear"], rtol=0, atol=0)
    torch.testing.assert_close(fresh.optimizer.state_dict()["state"], state["optimizer"]["state"],
                               rtol=0, atol=0)


def test_probe_rejects_bad_arguments_and_missing_sizes() -> None:
    with pytest.raises(ValueError, match="num_classes must be >= 2, got 1"):
        OnlineProbe(num_classes=1)
    with pytest.raises(ValueError, match="lr must be > 0, got 0"):
        OnlineProbe(lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        OnlineProbe(momentum=1.0)
    # Unlabeled data and no num_classes anywhere: the probe switches itself off, training runs.
    probe = OnlineProbe()
    trainer = _trainer(probe, epochs=1)
    loader = DataLoader(TensorDataset(*_separable(8, 0)))
    with pytest.warns(UserWarning, match="OnlineProbe is disabled"):
        trainer.fit(_FeatureModule(), train_dataloaders=loader)
    assert probe.linear is None and "train/probe_acc_step" not in trainer.callback_metrics
    assert trainer.global_step == 8


class _SharedDecayProbe(OnlineProbe):
    """Known-bad: one SGD for the whole grid, so every head gets the first weight decay."""

    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        super().setup(trainer, pl_module, stage)
        self.optimizer = torch.optim.SGD(
            [{"params": list(h.parameters()), "lr": s.lr} for s, h in
             zip(self.specs, self.linear.heads, strict=True)],
            lr=self.lr, momentum=self.momentum, weight_decay=self.specs[0].weight_decay)


@pytest.mark.parametrize("probe_class, equal", [(OnlineProbe, True), (_SharedDecayProbe, False)])
def test_every_head_of_a_grid_equals_that_probe_alone(probe_class: type, equal: bool,
                                                       capsys: pytest.CaptureFixture) -> None:
    x, y = _separable(48, 4)
    xv, yv = _separable(30, 5)
    train = DataLoader(TensorDataset(x, y), batch_size=8)
    val = [DataLoader(TensorDataset(xv, yv), batch_size=8)] * 2
    grid = probe_class(num_classes=CLASSES, lrs=[0.5, 0.01], weight_decays=[0.1, 0.0])
    trainer = _trainer(grid, epochs=2)
    trainer.fit(_FeatureModule(), train_dataloaders=train, val_dataloaders=val)
    top1 = {}
    for i, spec in enumerate(grid.specs):
        alone = OnlineProbe(num_classes=CLASSES, lr=spec.lr, weight_decay=spec.weight_decay)
        alone_trainer = _trainer(alone, epochs=2)
        alone_trainer.fit(_FeatureModule(), train_dataloaders=train, val_dataloaders=val)
        close = torch.allclose(grid.linear.heads[i].weight, alone.linear.heads[0].weight,
                               rtol=0, atol=1e-6)
        assert close == (equal or spec.weight_decay == grid.specs[0].weight_decay), spec.name
        top1[spec.name] = float(trainer.callback_metrics[f"val/probe_grid_top1/{spec.name}"])
        if equal:
            assert top1[spec.name] == float(alone_trainer.callback_metrics["val/probe_top1"])
    assert float(trainer.callback_metrics["val/probe_top1"]) == max(top1.values())
    assert "OnlineProbe grid (4 heads" in capsys.readouterr().out


def test_probe_state_from_before_the_grid_loads() -> None:
    """Its state held one nn.Linear's weight and bias."""
    probe = OnlineProbe(num_classes=CLASSES)
    probe.setup(None, _FeatureModule(), "fit")  # type: ignore[arg-type]
    weight, bias = torch.randn(CLASSES, DIM), torch.randn(CLASSES)
    probe.load_state_dict({"linear": {"weight": weight, "bias": bias},
                           "optimizer": probe.optimizer.state_dict()})
    probe._ready(_FeatureModule())
    assert torch.equal(probe.linear.heads[0].weight, weight)
    assert torch.equal(probe.linear.heads[0].bias, bias)


class _ViTModule(pl.LightningModule):
    """A frozen-in-effect ViT backbone with stochastic depth; the step returns its features of
    the first view of ``([view], targets)`` batches."""

    def __init__(self) -> None:
        super().__init__()
        from ssl_lightning.backbones import ViT

        torch.manual_seed(0)
        self.backbone = ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2,
                            drop_path_rate=0.5)
        self.feature_dim = 8
        self.w = nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx) -> dict[str, Tensor]:
        (view,), y = batch
        with torch.no_grad():
            features = self.backbone(view)
        return {"loss": (self.w**2).sum(), "features": features, "targets": y}

    def validation_step(self, batch, batch_idx, dataloader_idx=0) -> dict[str, Tensor]:
        return {"features": self.backbone(batch[0]), "targets": batch[1]}

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD([self.w], lr=0.1)


class _DeviceViewsModule(_ViTModule):
    """Makes its training view after the transfer (as ``DeviceViews`` in the data modules'
    ``on_after_batch_transfer``): flipped and scaled."""

    @staticmethod
    def view(x: Tensor) -> Tensor:
        return 2 * x.flip(-1)

    def on_after_batch_transfer(self, batch, dataloader_idx):  # type: ignore[no-untyped-def]
        if not self.trainer.training:
            return batch
        (view,), y = batch
        return [self.view(view)], y


class _ViewsLoader(DataLoader):
    """Batches ``([images], targets)``, as the SSL data modules' (views, targets)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        for x, y in super().__iter__():
            yield [x], y


class _TrainModeProbe(OnlineProbe):
    """Known-bad: the extra forward in train mode (stochastic depth on, random numbers drawn)."""

    def _features(self, pl_module, pooled, images):  # type: ignore[no-untyped-def]
        from ssl_lightning.callbacks.probe_grid import source_features

        features = {(1, "pooled"): pooled}
        with torch.no_grad():
            features.update(source_features(pl_module.backbone, images, self.token_sources))
        return features


@pytest.mark.parametrize("probe_class, module_class, reference_view, equal", [
    (OnlineProbe, _ViTModule, None, True),
    (_TrainModeProbe, _ViTModule, None, False),  # known-bad: stochastic depth on
    (OnlineProbe, _DeviceViewsModule, _DeviceViewsModule.view, True),
    (OnlineProbe, _DeviceViewsModule, None, False),  # the loader's images, not the view
])
def test_token_sources_equal_hand_run_sgd_on_eval_mode_features(
        probe_class: type, module_class: type, reference_view, equal: bool) -> None:
    """Heads on cls / cls+mean of the last 1 and 2 blocks: each equals SGD on the features of
    an eval-mode forward of the first view as the method sees it (after the transfer hook);
    the backbone stays in train mode."""
    from ssl_lightning.callbacks.probe_grid import source_features

    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(24, 3, 8, 8, generator=g), torch.arange(24) % CLASSES
    probe = probe_class(num_classes=CLASSES, lrs=[0.5], last_blocks=[1, 2],
                        poolings=["cls", "cls+mean"])
    module = module_class()
    _trainer(probe, epochs=1).fit(module, train_dataloaders=_ViewsLoader(TensorDataset(x, y),
                                                                         batch_size=8))
    assert module.backbone.training and module.backbone.blocks[1].drop_path.training
    reference_backbone = _ViTModule().backbone.eval()
    for i, spec in enumerate(probe.specs):
        with torch.no_grad():
            images = x if reference_view is None else reference_view(x)
            features = source_features(reference_backbone, images, [spec.source])[spec.source]
        head = nn.Linear(features.shape[1], CLASSES)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        optimizer = torch.optim.SGD(head.parameters(), lr=spec.lr, momentum=0.9)
        for xb, yb in zip(features.split(8), y.split(8), strict=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(head(xb), yb).backward()
            optimizer.step()
        close = torch.allclose(probe.linear.heads[i].weight, head.weight, rtol=0, atol=1e-6)
        assert close == equal, spec.name
    assert [s.name for s in probe.specs] == [
        "blocks1_cls_lr0.5_wd0", "blocks1_cls+mean_lr0.5_wd0", "blocks2_cls_lr0.5_wd0",
        "blocks2_cls+mean_lr0.5_wd0"]


def test_token_sources_validate_on_val_images_and_pooled_alone_adds_no_forward() -> None:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.arange(16) % CLASSES
    val = [DataLoader(TensorDataset(x, y), batch_size=8)] * 2
    calls: list[int] = []

    def count(*_: object) -> None:
        calls.append(1)

    for poolings in (["pooled"], ["pooled", "mean"]):
        module = _ViTModule()
        hook = module.backbone.register_forward_hook(count)
        probe = OnlineProbe(num_classes=CLASSES, lrs=[0.5], poolings=poolings)
        trainer = _trainer(probe, epochs=1)
        trainer.fit(module, train_dataloaders=_ViewsLoader(TensorDataset(x, y), batch_size=8),
                    val_dataloaders=val)
        hook.remove()
        top1 = {k: float(v) for k, v in trainer.callback_metrics.items() if "probe_grid" in k}
        forwards = len(calls)
        calls.clear()
        if poolings == ["pooled"]:
            assert forwards == 2 + 4  # the steps' and validation_step's forwards only
        else:  # one more per train batch and per val batch of the probed val loader
            assert forwards == 2 + 4 + 2 + 2
            assert set(top1) == {"val/probe_grid_top1/blocks1_pooled_lr0.5_wd0",
                                 "val/probe_grid_top1/blocks1_mean_lr0.5_wd0"}


def test_token_sources_refused_up_front_on_a_backbone_without_tokens() -> None:
    x, y = _separable(8, 0)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(ValueError, match="has no backbone attribute: use poolings"):
        _trainer(OnlineProbe(num_classes=CLASSES, poolings=["cls"]), 1).fit(
            _FeatureModule(), train_dataloaders=loader)
    module = _FeatureModule()
    module.backbone = nn.Linear(DIM, DIM)
    with pytest.raises(ValueError, match="needs a token backbone .* use poolings"):
        _trainer(OnlineProbe(num_classes=CLASSES, poolings=["cls"]), 1).fit(
            module, train_dataloaders=loader)
    vit_module = _ViTModule()
    with pytest.raises(ValueError, match="last_blocks 3 > the backbone's 2 blocks"):
        _trainer(OnlineProbe(num_classes=CLASSES, last_blocks=[3], poolings=["cls"]), 1).fit(
            vit_module, train_dataloaders=loader)
    assert vit_module.global_step == 0


def test_attentive_heads_refused_before_step_0_on_a_cnn_in_one_line() -> None:
    from ssl_lightning.backbones import SmallConvNet

    module = _FeatureModule()
    module.backbone = SmallConvNet((8,))
    loader = DataLoader(TensorDataset(*_separable(8, 0)), batch_size=8)
    with pytest.raises(ValueError) as error:
        _trainer(OnlineProbe(num_classes=CLASSES, poolings=["pooled", "tokens"]), 1).fit(
            module, train_dataloaders=loader)
    assert str(error.value) == (
        "pooling 'tokens' (the attentive heads' patch tokens) needs a token backbone (a ViT: "
        "blocks, norm, num_prefix_tokens); SmallConvNet has only its pooled output: use "
        "poolings [pooled].")
    assert module.global_step == 0


# --------------------------------------------------------------------------- attentive heads
ATTENTIVE = dict(num_classes=CLASSES, lrs=[0.01], weight_decays=[0.0, 0.1], last_blocks=[1, 2],
                 optimizer="adamw", attentive_num_heads=2)


def _views64(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % CLASSES
    return torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) + y[:, None, None, None], y


def _probe_head(probe: OnlineProbe, i: int) -> nn.Module:
    """Head ``i`` of the grid (the order of ``specs``), linear or attentive."""
    if i in probe.linear_index:
        return probe.linear.heads[probe.linear_index.index(i)]
    return probe.attentive.heads[probe.attentive_index.index(i)]


class _WrongBlockProbe(OnlineProbe):
    """Known-bad: the last-block attentive heads read the tokens of the block before."""

    def _features(self, pl_module, pooled, images):  # type: ignore[no-untyped-def]
        from ssl_lightning.callbacks.probe_grid import source_features

        features = super()._features(pl_module, pooled, images)
        pl_module.backbone.eval()
        with torch.no_grad():
            both = source_features(pl_module.backbone, images, [(2, "tokens")])[(2, "tokens")]
        pl_module.backbone.train()
        features[(1, "tokens")] = both[..., :8]
        return features


@pytest.mark.parametrize("probe_class, bad_blocks", [
    (OnlineProbe, set()),
    (_TrainModeProbe, {1, 2}),  # known-bad: stochastic depth on in the probe's forward
    (_WrongBlockProbe, {1}),  # known-bad: tokens of the wrong block
])
def test_attentive_heads_equal_hand_run_adamw_on_eval_mode_tokens(
        probe_class: type, bad_blocks: set[int]) -> None:
    """A grid of linear (cls) and attentive (tokens) heads over the last 1 and 2 blocks, in
    float64, some targets unlabeled: each attentive head equals its own initial weights trained
    by hand with AdamW (decay on weights only) on the tokens of an eval-mode forward."""
    from ssl_lightning.callbacks.probe_grid import source_features

    x, y = _views64(24, 8)
    y[::7] = -1
    probe = probe_class(poolings=["cls", "tokens"], **ATTENTIVE)
    module = _ViTModule()
    _trainer(probe, 1, precision="64-true").fit(
        module, train_dataloaders=_ViewsLoader(TensorDataset(x, y), batch_size=8))
    assert module.backbone.training and len(probe.attentive_index) == 4
    reference_backbone = _ViTModule().backbone.double().eval()
    for i in probe.attentive_index:
        spec = probe.specs[i]
        alone = OnlineProbe(**{**ATTENTIVE, "lrs": [spec.lr],
                               "weight_decays": [spec.weight_decay],
                               "last_blocks": [spec.last_blocks]}, poolings=["tokens"])
        alone.setup(None, _ViTModule(), "fit")  # type: ignore[arg-type]
        head = alone.attentive.heads[0].double()  # its initial weights, as the grid's head's
        start = head[1].weight.clone()
        params = list(head.parameters())
        optimizer = torch.optim.AdamW([
            {"params": [p for p in params if p.ndim > 1], "weight_decay": spec.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=spec.lr)
        for xb, yb in zip(x.split(8), y.split(8), strict=True):
            with torch.no_grad():
                tokens = source_features(reference_backbone, xb, [spec.source])[spec.source]
            optimizer.zero_grad()
            keep = yb >= 0
            nn.functional.cross_entropy(head(tokens[keep]), yb[keep]).backward()
            optimizer.step()
        trained = _probe_head(probe, i)
        assert trained[0].queries.dtype == torch.float64
        close = all(torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in
                    zip(trained.state_dict().values(), head.state_dict().values(), strict=True))
        assert close == (spec.last_blocks not in bad_blocks), spec.name
        assert not torch.allclose(start, head[1].weight, rtol=0, atol=1e-4)  # it trained


def test_pooled_token_and_attentive_heads_over_two_depths_each_equal_that_head_alone() -> None:
    """``pooled`` with ``last_blocks [1, 2]`` in one grid with cls and tokens: 5 sources (the
    pooled heads once), every head's weights and val top-1 equal that head's probe alone."""
    x, y = _views64(24, 9)
    xv, yv = _views64(12, 10)
    val = [DataLoader(TensorDataset(xv, yv), batch_size=6)] * 2
    kwargs = dict(num_classes=CLASSES, lrs=[0.05], attentive_num_heads=2)

    def fit(**grid: object) -> tuple[OnlineProbe, dict[str, float]]:
        probe = OnlineProbe(**kwargs, **grid)
        trainer = _trainer(probe, 2, precision="64-true")
        trainer.fit(_ViTModule(), train_dataloaders=_ViewsLoader(TensorDataset(x, y), batch_size=8),
                    val_dataloaders=val)
        return probe, {k: float(v) for k, v in trainer.callback_metrics.items()}

    grid, metrics = fit(last_blocks=[1, 2], poolings=["pooled", "cls", "tokens"])
    assert [s.source for s in grid.specs] == [(1, "pooled"), (1, "cls"), (1, "tokens"),
                                              (2, "cls"), (2, "tokens")]
    for i, spec in enumerate(grid.specs):
        alone, alone_metrics = fit(last_blocks=[spec.last_blocks], poolings=[spec.pooling])
        torch.testing.assert_close(_probe_head(grid, i).state_dict(),
                                   _probe_head(alone, 0).state_dict(), rtol=0, atol=1e-12,
                                   msg=spec.name)
        assert metrics[f"val/probe_grid_top1/{spec.name}"] == alone_metrics["val/probe_top1"]
    assert metrics["val/probe_top1"] == max(v for k, v in metrics.items() if "grid" in k)


class _StatelessProbe(OnlineProbe):
    """Known-bad: nothing of the probe goes into the checkpoint."""

    def state_dict(self) -> dict:
        return {}


@pytest.mark.parametrize("probe_class, equal", [(OnlineProbe, True), (_StatelessProbe, False)])
def test_a_grid_with_attentive_heads_resumes_exactly(tmp_path, probe_class: type,
                                                      equal: bool) -> None:
    """2 epochs straight = 1 epoch, last.ckpt, resumed to 2: linear and attentive heads,
    AdamW moments and the best head, bit for bit (float64)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    x, y = _views64(16, 11)
    xv, yv = _views64(6, 12)
    loaders = dict(train_dataloaders=_ViewsLoader(TensorDataset(x, y), batch_size=8),
                   val_dataloaders=[DataLoader(TensorDataset(xv, yv), batch_size=6)] * 2)

    def fit(probe: OnlineProbe, epochs: int, *callbacks: pl.Callback, **kwargs: object
            ) -> dict:
        _trainer(probe, epochs, precision="64-true", callbacks=[probe, *callbacks],
                 enable_checkpointing=bool(callbacks)).fit(_ViTModule(), **loaders, **kwargs)
        probe._ready(_ViTModule().double())  # a state restored after the last step: applied
        return OnlineProbe.state_dict(probe)

    straight = fit(OnlineProbe(poolings=["cls", "tokens"], **ATTENTIVE), 2)
    first = fit(probe_class(poolings=["cls", "tokens"], **ATTENTIVE), 1,
                ModelCheckpoint(dirpath=tmp_path, save_last=True))
    resumed = fit(probe_class(poolings=["cls", "tokens"], **ATTENTIVE), 2,
                  ckpt_path=str(tmp_path / "last.ckpt"))
    assert set(straight) == {"linear", "attentive", "optimizer", "best_head"}
    assert not torch.equal(first["attentive"]["heads.0.1.weight"],
                           straight["attentive"]["heads.0.1.weight"])
    same = [torch.equal(value, resumed[part][key])
            for part in ("linear", "attentive") for key, value in straight[part].items()]
    assert all(same) == equal and any(same) == equal
    if equal:
        torch.testing.assert_close(resumed["optimizer"], straight["optimizer"], rtol=0, atol=0)
        assert resumed["best_head"] == straight["best_head"]
