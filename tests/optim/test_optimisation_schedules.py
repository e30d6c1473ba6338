"""Optimisation schedules shared by the methods (docs/optimisation_schedules.md): the cosine
weight-decay schedule (DINO; I-JEPA's code), layer-wise lr decay with the patch-embedding
multiplier (BEiT; DINOv2's code) through the warm-up + cosine lr schedule, exact values after a
resume, DINOv2's per-module gradient clipping, and bad input before training.

The references below are written from the formulas, not from the package's helpers."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from mim_utils import SIZE, tiny_ijepa
from momentum_utils import cpu_trainer, views_loader
from multicrop_utils import multicrop_loader
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.methods import DINO, DINOv2, SwAV
from ssl_lightning.optim import epoch_linspace

DEPTH, DECAY, PATCH_MULT, PEAK, FINAL_RATIO = 2, 0.8, 0.3, 1e-3, 0.1
WD, WD_END = 0.04, 0.4
INPUT_NAMES = {"patch_embed", "cls_token", "pos_embed", "register_tokens", "mask_token"}


def cosine_wd(step: int, total: int) -> float:
    """DINO / I-JEPA: WD_END + (WD − WD_END)·(1 + cos(π·step/total))/2."""
    return WD_END + (WD - WD_END) * 0.5 * (1 + math.cos(math.pi * step / total))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to the peak over ``warmup`` steps, then cosine to FINAL_RATIO."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / (total - warmup)
    return FINAL_RATIO + (1 - FINAL_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def layer_multiplier(name: str) -> float:
    """BEiT / DINOv2: decay^(depth + 1 − layer); tokens and patch embedding at layer 0, block i
    at i + 1, the final norm and every head at depth + 1; the patch embedding × PATCH_MULT."""
    parts = name.split(".")
    layer = DEPTH + 1
    if parts[0] == "backbone" and parts[1] in INPUT_NAMES:
        layer = 0
    elif parts[0] == "backbone" and parts[1] == "blocks":
        layer = int(parts[2]) + 1
    factor = DECAY ** (DEPTH + 1 - layer)
    return factor * PATCH_MULT if name.startswith("backbone.patch_embed.") else factor


class Recorder(pl.Callback):
    """Per optimiser step: the lr (before the step) and weight decay (of the step) of every
    optimised parameter, by name."""

    def __init__(self) -> None:
        self.lr: dict[int, dict[str, float]] = {}
        self.wd: dict[int, dict[str, float]] = {}

    def _by_name(self, trainer: pl.Trainer, pl_module: pl.LightningModule, key: str):  # type: ignore[no-untyped-def]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        return {names[id(p)]: group[key] for group in trainer.optimizers[0].param_groups
                for p in group["params"]}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.lr[trainer.global_step] = self._by_name(trainer, pl_module, "lr")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.wd[trainer.global_step - 1] = self._by_name(trainer, pl_module, "weight_decay")


def tiny_dinov2(**kwargs) -> DINOv2:  # type: ignore[no-untyped-def]
    vit = ViT(image_size=16, patch_size=4, embed_dim=16, depth=DEPTH, num_heads=2,
              mask_token=True, num_registers=1)
    args = dict(head_out_dim=16, head_hidden_dim=16, head_bottleneck_dim=8, patch_out_dim=8,
                num_local_crops=2, optimizer="adamw", lr=PEAK, lr_scaling="none",
                warmup_epochs=1.5, final_lr_ratio=FINAL_RATIO, weight_decay=WD,
                weight_decay_end=WD_END, layer_decay=DECAY, patch_embed_lr_multiplier=PATCH_MULT,
                warmup_teacher_temperature_epochs=1, freeze_last_layer_epochs=1)
    return DINOv2(vit, **{**args, **kwargs})


def tiny_swav() -> SwAV:
    return SwAV(SmallConvNet((8, 16), norm="group"), projection_hidden_dim=16, projection_dim=8,
                num_prototypes=10, freeze_prototypes_steps=3, queue_size=8, lr=0.5,
                lr_scaling="none", warmup_epochs=0, weight_decay=WD, weight_decay_end=WD_END)


@pytest.mark.parametrize("name", ["ijepa", "swav"])
def test_weight_decay_follows_the_cosine_over_a_run(tmp_path, name: str) -> None:
    """The weight decay rises 0.04 -> 0.4 on the weights, never on biases and norms; the value
    of step s is the cosine at s / total. I-JEPA: its defaults, AdamW, the predictor included;
    SwAV: LARS, through its own optimiser-step hook."""
    torch.manual_seed(0)
    if name == "ijepa":
        model: pl.LightningModule = tiny_ijepa()  # weight_decay(_end): IJEPA's defaults
        assert (model.hparams["weight_decay"], model.hparams["weight_decay_end"]) == (WD, WD_END)
        loader = views_loader(16, 4, num_views=1, size=SIZE)
    else:
        model, loader = tiny_swav(), multicrop_loader()
    recorder = Recorder()
    cpu_trainer(str(tmp_path), 1, callbacks=[recorder], enable_checkpointing=False).fit(
        model, loader)
    total = 4
    assert sorted(recorder.wd) == list(range(total))
    params = dict(model.named_parameters())
    head = "predictor." if name == "ijepa" else "prototypes."
    for step, values in recorder.wd.items():
        assert any(n.startswith(head) for n in values)
        for n, wd in values.items():
            expected = 0.0 if params[n].ndim <= 1 else cosine_wd(step, total)
            assert wd == pytest.approx(expected, rel=1e-12, abs=1e-15), (step, n)
    decays = [max(values.values()) for _, values in sorted(recorder.wd.items())]
    assert all(a < b for a, b in zip(decays, decays[1:], strict=False))


def test_layer_decay_lrs_and_weight_decay_through_the_schedule_and_a_resume(tmp_path) -> None:
    """DINOv2 with a 2-block ViT: every parameter's lr is peak × warm-up/cosine factor × its
    layer multiplier at warm-up and cosine steps; a run resumed at step 2 (inside the warm-up)
    has the lr and weight decay of every parameter of the uninterrupted run at every step."""
    torch.manual_seed(0)
    full_rec = Recorder()
    ckpt = ModelCheckpoint(dirpath=f"{tmp_path}/ckpt", save_top_k=-1, every_n_epochs=1,
                           filename="{epoch}")
    model = tiny_dinov2()
    cpu_trainer(str(tmp_path), 3, callbacks=[ckpt, full_rec]).fit(model, multicrop_loader(8))
    total, warmup = 6, 3  # 2 steps per epoch, warmup_epochs 1.5
    params = dict(model.named_parameters())
    student = {n for n, p in params.items() if p.requires_grad}
    assert sorted(full_rec.lr) == list(range(total))
    for step in range(total):
        assert set(full_rec.lr[step]) == student
        for name, lr in full_rec.lr[step].items():
            expected = PEAK * lr_factor(step, warmup, total) * layer_multiplier(name)
            assert lr == pytest.approx(expected, rel=1e-12), (step, name)
        for name, wd in full_rec.wd[step].items():
            expected = 0.0 if params[name].ndim <= 1 else cosine_wd(step, total)
            assert wd == pytest.approx(expected, rel=1e-12, abs=1e-15), (step, name)
    torch.manual_seed(1)
    resumed_rec = Recorder()
    cpu_trainer(str(tmp_path), 3, callbacks=[resumed_rec], enable_checkpointing=False).fit(
        tiny_dinov2(), multicrop_loader(8), ckpt_path=f"{tmp_path}/ckpt/epoch=0.ckpt")
    assert sorted(resumed_rec.lr) == list(range(2, total))
    for step in range(2, total):
        assert resumed_rec.lr[step] == full_rec.lr[step], step
        assert resumed_rec.wd[step] == full_rec.wd[step], step


def test_without_layer_decay_the_two_groups_of_before() -> None:
    """layer_decay = patch multiplier = 1: weights with decay and biases/norms without, in two
    groups, no multiplier; the decay group is the one the weight-decay schedule changes."""
    groups = tiny_dinov2(layer_decay=1.0, patch_embed_lr_multiplier=1.0).param_groups()
    assert [sorted(k for k in g if k != "params") for g in groups] == [
        ["weight_decay", "weight_decay_schedule"], ["exclude_from_lars", "weight_decay"]]
    assert all(p.ndim > 1 for p in groups[0]["params"])
    assert all(p.ndim <= 1 for p in groups[1]["params"])


def test_per_module_clipping_clips_each_modules_gradient_norm() -> None:
    """DINOv2's code: each student module's (backbone, head, iBOT head) gradient norm is
    clipped to clip_grad; the per-parameter mode clips each tensor (DINO)."""
    clip = 3.0
    model = tiny_dinov2(clip_grad=clip, clip_grad_mode="per_module", freeze_last_layer_epochs=0)
    modules = {"backbone": model.backbone, "head": model.head, "patch_head": model.patch_head}
    scales = {"backbone": 10.0, "head": 1e-3, "patch_head": 1.0}
    g = torch.Generator().manual_seed(0)
    expected = {}
    for key, module in modules.items():
        trained = [p for p in module.parameters() if p.requires_grad]
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) * scales[key]
                 for p in trained]
        norm = math.sqrt(sum(float((x * x).sum()) for x in grads))
        factor = min(1.0, clip / (norm + 1e-6))
        for p, x in zip(trained, grads, strict=True):
            p.grad = x.float()
            expected[id(p)] = x * factor
    model.adjust_gradients_(epoch=0)
    for module in modules.values():
        for p in module.parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad.double(), expected[id(p)], rtol=1e-5,
                                           atol=1e-9)
    backbone_norm = torch.linalg.vector_norm(torch.cat(
        [p.grad.flatten() for p in model.backbone.parameters()]))
    assert backbone_norm.item() == pytest.approx(clip, rel=1e-5)


@pytest.mark.parametrize(
    ("make", "message"),
    [(lambda: tiny_dinov2(layer_decay=0.0), "layer_decay must be in \\(0, 1\\]"),
     (lambda: tiny_dinov2(layer_decay=-0.5), "layer_decay must be in \\(0, 1\\]"),
     (lambda: tiny_dinov2(layer_decay=1.5), "layer_decay must be in \\(0, 1\\]"),
     (lambda: tiny_dinov2(patch_embed_lr_multiplier=0.0), "patch_embed_lr_multiplier must be"),
     (lambda: DINO(SmallConvNet((4, 8)), layer_decay=0.9),
      "layer_decay needs a ViT backbone.*SmallConvNet has none"),
     (lambda: DINO(SmallConvNet((4, 8)), patch_embed_lr_multiplier=0.2),
      "patch_embed_lr_multiplier needs a ViT backbone.*SmallConvNet"),
     (lambda: tiny_ijepa(weight_decay_end=-0.1), "weight_decay_end must be >= 0"),
     (lambda: tiny_dinov2(clip_grad_mode="global"), "clip_grad_mode must be")],
    ids=["decay0", "decay-neg", "decay>1", "patch0", "convnet-decay", "convnet-patch",
         "wd-end", "clip-mode"],
)
def test_bad_input_is_refused_at_construction(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


def test_epoch_linspace_is_numpy_linspace_per_epoch():
    """DINO / iBOT's official teacher-temperature schedule: np.linspace over the warm-up epochs,
    then the final value (written out: 3 epochs give 0.04, 0.055, 0.07)."""
    for warmup in (0, 1, 2, 3, 7):
        official = [0.04 + (0.07 - 0.04) * i / max(warmup - 1, 1) for i in range(warmup)]
        official = (official + [0.07] * 10)[:10]
        ours = [epoch_linspace(e, warmup, 0.04, 0.07) for e in range(10)]
        assert ours == pytest.approx(official, abs=1e-15), warmup
    assert [epoch_linspace(e, 3, 0.04, 0.07) for e in range(3)] == pytest.approx(
        [0.04, 0.055, 0.07])
