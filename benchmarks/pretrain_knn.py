"""kNN top-1 on the CIFAR-10 test split: random-init backbone vs a short pre-training.

``--method`` takes any registry name (``python -m ssl_lightning list methods``; the methods come
from :func:`~ssl_lightning.methods.registry.method_entries`) or a variant of one
(:data:`VARIANTS`: ``simclr_bank``, SimCLR with an NT-Xent memory bank; ``dclw``, DCL weighted).
A method with a tuned recipe (:data:`RECIPES`, keyed by registry name) runs it: SimCLR
(default), NNCLR, DCL, SupCon, MoCo v2+, FastSiam (4 views), NNSiam, NNBYOL, DirectCLR, ReSSL
(a strong and a weak view) and All4One each with the same backbone,
projection size, optimiser and schedule (the methods without a temperature ignore
``--temperature``); MSN and PMSN mask patch tokens, so they run a small ViT with their own
optimiser (AdamW, lr 1e-3) on a target, an anchor and one focal view, and SimMIM (mask
tokens) and AIM (prefix-causal, mean pooled) the same ViT on one view with their configs'
optimisers; DeepCluster v2 takes its
config's 3 x 3000 clusters and temperature 0.1, SMoG 300 groups, a 300-batch bank, τ 0.1.
Any other registered method runs its default recipe (:func:`default_method`): the registry's
instance of its class on the SmallConvNet of ``--widths`` with one view per crop of its
registry entry's views (two views, or multi-crop; sides x 4: 8 px -> 32 px), or, for a method
whose registry instance is a ViT (its image size is fixed there), on that small ViT with the
registry's crop sides (8 px global crops of the CIFAR images).

``--tiny`` checks the pipeline in seconds: a few synthetic images in a temporary folder, one
training step, a kNN bank of the few train images (no dataset needed).

Both numbers come from this one script, with the same backbone architecture, data module,
kNN bank and :class:`~ssl_lightning.callbacks.KNNCallback` (weighted cosine kNN, k=200,
T=0.07, Wu et al. 2018). The final checkpoint is saved (default
``/work/runs/pretrain_knn/last.ckpt``) for the offline evaluation tools.

Run (CPU, one thread, about 25 minutes with the defaults)::

    mkdir -p /work/data && tar -xzf ../shared/data/cifar10-jpeg.tar.gz -C /work/data
    python benchmarks/pretrain_knn.py --data-root /work/data/cifar10 --epochs 8
    python benchmarks/pretrain_knn.py --tiny --method dino   # seconds, no dataset
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
from PIL import Image
from torch import nn

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.callbacks import KNNCallback, OnlineProbe
from ssl_lightning.data import CIFAR10DataModule, DeviceViews, UInt8Image
from ssl_lightning.data.transforms import MultiViewTransform, get_preset, simclr_augmentation
from ssl_lightning.methods import (
    AIM,
    DCL,
    MMCR,
    MSN,
    NNBYOL,
    NNCLR,
    PMSN,
    WMSE,
    All4One,
    DeepClusterV2,
    DirectCLR,
    FastSiam,
    LeJEPA,
    MoCoV2Plus,
    NNSiam,
    ReSSL,
    SimCLR,
    SimMIM,
    SMoG,
    SSLMethod,
    SupCon,
    TiCo,
    VIbCReg,
)
from ssl_lightning.methods.registry import MethodEntry, method_entries, method_entry

#: Image side of the benchmark (CIFAR-10), and of the registry's small instances' global crops:
#: a registry view of side ``s`` becomes a ``s * IMAGE_SIZE // REGISTRY_SIZE`` px crop.
IMAGE_SIZE, REGISTRY_SIZE = 32, 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default="/work/data/cifar10")
    parser.add_argument("--out", default="/work/runs/pretrain_knn/last.ckpt",
                        help="where the pre-trained checkpoint is written")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128],
                        help="SmallConvNet stage widths")
    parser.add_argument("--lr", type=float, default=1.0, help="LARS base lr (× batch / 256)")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--knn-bank", type=int, default=10000,
                        help="train images in the kNN bank (fixed subset; all test images query)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="data-loading processes")
    parser.add_argument("--max-minutes", type=float, default=30.0, help="hard cap on training")
    parser.add_argument("--limit-train-batches", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="simclr", choices=method_names(),
                        help="a registry name or a variant (VARIANTS)")
    parser.add_argument("--queue", type=int, default=4096,
                        help="NNCLR support set / NT-Xent memory bank size")
    parser.add_argument("--tiny", action="store_true",
                        help="pipeline check: a few synthetic images, one training step")
    return parser.parse_args(argv)


def method_names() -> list[str]:
    """Every name ``--method`` takes: the registered methods and the variants."""
    return sorted([entry.name for entry in method_entries()] + list(VARIANTS))


def registry_name(name: str) -> str:
    """The registered method that ``name`` (a registry name or a variant) trains."""
    return VARIANTS.get(name, name)


def build_method(name: str, args: argparse.Namespace) -> SSLMethod:
    """The method to pre-train: its tuned recipe (all share backbone, 512-wide heads, LARS and
    the schedule), else its default recipe (:func:`default_method`)."""
    if name not in RECIPES:
        return default_method(method_entry(registry_name(name)), args)
    common = dict(projection_hidden_dim=512, temperature=args.temperature, optimizer="lars",
                  lr=args.lr, lr_scaling="linear", weight_decay=1e-6, warmup_epochs=1,
                  final_lr_ratio=0.0)
    backbone = (_cifar_vit(**VIT_METHODS[name]) if name in VIT_METHODS
                else SmallConvNet(widths=tuple(args.widths)))
    return RECIPES[name](backbone, args.queue, common)


def default_method(entry: MethodEntry, args: argparse.Namespace) -> SSLMethod:
    """A method without a tuned recipe: the registry's instance of its class, on the SmallConvNet
    of ``--widths`` (any image size), or, for a ViT method, on the registry's own small ViT (its
    instance fixes the image size to the registry's 8 px crops)."""
    if _registry_vit(entry):
        return entry.small()
    return entry.small(SmallConvNet(widths=tuple(args.widths)))


def _registry_vit(entry: MethodEntry) -> bool:
    """Whether the registry's small instance of ``entry`` runs on a ViT."""
    return isinstance(entry.backbone(), ViT)


def _cifar_vit(**options: object) -> ViT:
    """The benchmark's ViT for 32 px images: patch 4, width 64, 4 blocks of 4 heads."""
    return ViT(image_size=IMAGE_SIZE, patch_size=4, embed_dim=64, depth=4, num_heads=4,
               **options)  # type: ignore[arg-type]


def build_views(name: str) -> dict[str, object]:
    """The data module's view arguments: a tuned recipe's batch-wise views (:data:`VIEWS`,
    :data:`WEAK_VIEWS`) made from uint8 images, else one SimCLR-augmented crop per view of the
    registry entry (two views or multi-crop; sides x 4 for the SmallConvNet, as they are for
    the registry's small ViT)."""
    if name in RECIPES:
        # Views made batch-wise from uint8 images: on CPU much cheaper than per-image PIL ops.
        return dict(train_transform=UInt8Image(),
                    device_transform=DeviceViews(preset="cifar", num_views=VIEWS.get(name, 2),
                                                 weak_views=WEAK_VIEWS.get(name, 0)))
    preset = get_preset("cifar")
    entry = method_entry(registry_name(name))
    scale = 1 if _registry_vit(entry) else IMAGE_SIZE // REGISTRY_SIZE
    sides = [side * scale for side in entry.views]
    return dict(train_transform=MultiViewTransform(
        [simclr_augmentation(side, preset.mean, preset.std,
                             jitter_strength=preset.jitter_strength, blur_p=preset.blur_p)
         for side in sides]))


def _msn(common: dict) -> dict:
    """MSN's own recipe (AdamW 1e-3, its temperature) with the shared head width."""
    return dict(projection_hidden_dim=common["projection_hidden_dim"], projection_dim=128,
                num_prototypes=1024, warmup_epochs=common["warmup_epochs"],
                lr_scaling="none", weight_decay_end=None)


#: A tuned recipe: ``recipe(backbone, queue size, shared settings)`` -> the method.
Recipe = Callable[[nn.Module, int, dict], SSLMethod]
#: The tuned recipes behind the published numbers, keyed by registry name (or variant). They
#: live here rather than in ``@register_method``: they read this script's arguments (``--queue``,
#: ``--temperature``, the shared LARS settings) and its 32 px ViT, which the package does not know.
RECIPES: dict[str, Recipe] = {
    "simclr": lambda b, q, c: SimCLR(b, projection_dim=128, **c),
    "simclr_bank": lambda b, q, c: SimCLR(b, projection_dim=128, queue_size=q, **c),
    "nnclr": lambda b, q, c: NNCLR(b, projection_dim=128, predictor_hidden_dim=512,
                                   queue_size=q, **c),
    "dcl": lambda b, q, c: DCL(b, projection_dim=128, **c),
    "dclw": lambda b, q, c: DCL(b, projection_dim=128, weight_sigma=0.5, **c),
    "supcon": lambda b, q, c: SupCon(b, projection_dim=128, **c),
    "moco_v2_plus": lambda b, q, c: MoCoV2Plus(b, projection_dim=128, queue_size=q, **c),
    "fastsiam": lambda b, q, c: FastSiam(b, projection_dim=128, predictor_hidden_dim=128,
                                         **_no_temperature(c)),
    "nnsiam": lambda b, q, c: NNSiam(b, projection_dim=128, predictor_hidden_dim=128,
                                     queue_size=q, **_no_temperature(c)),
    "nnbyol": lambda b, q, c: NNBYOL(b, projection_dim=128, queue_size=q, **_no_temperature(c)),
    "directclr": lambda b, q, c: DirectCLR(
        b, loss_dim=b.num_features // 2,
        **{k: v for k, v in c.items() if k != "projection_hidden_dim"}),
    "lejepa": lambda b, q, c: LeJEPA(b, projection_dim=64, num_slices=256,
                                     **_no_temperature(c)),
    "tico": lambda b, q, c: TiCo(b, projection_dim=128, **_no_temperature(c)),
    "mmcr": lambda b, q, c: MMCR(b, projection_dim=128, **_no_temperature(c)),
    "wmse": lambda b, q, c: WMSE(b, projection_dim=64, whitening_size=128,
                                 **_no_temperature(c)),
    "vibcreg": lambda b, q, c: VIbCReg(b, expander_hidden_dim=512, expander_dim=512,
                                       iternorm_groups=32,
                                       **{k: v for k, v in _no_temperature(c).items()
                                          if k != "projection_hidden_dim"}),
    "msn": lambda b, q, c: MSN(b, **_msn(c)),
    # the config's 3 heads of 3000 clusters and its temperature 0.1 (configs/deepcluster_v2.yaml)
    "deepcluster_v2": lambda b, q, c: DeepClusterV2(b, projection_dim=128,
                                                    num_prototypes=(3000, 3000, 3000),
                                                    **{**c, "temperature": 0.1}),
    # the config's groups, bank, reset interval and temperature (configs/smog.yaml)
    "smog": lambda b, q, c: SMoG(b, projection_dim=128, num_groups=300, reset_every=300,
                                 queue_size=300 * 128, momentum_base=0.99,
                                 momentum_schedule="constant", **{**c, "temperature": 0.1}),
    "pmsn": lambda b, q, c: PMSN(b, **_msn(c)),
    # their configs' optimisers (AdamW, lr 5e-5 / 6.25e-5 x B/256), 1 warm-up epoch
    "simmim": lambda b, q, c: SimMIM(b, image_size=32, mask_patch_size=8,
                                     warmup_epochs=c["warmup_epochs"], lr_scaling="linear"),
    "aim": lambda b, q, c: AIM(b, image_size=32, head_hidden_dim=256,
                               warmup_epochs=c["warmup_epochs"], lr_scaling="linear"),
    "ressl": lambda b, q, c: ReSSL(b, projection_dim=128, queue_size=q, **_no_temperature(c)),
    "all4one": lambda b, q, c: All4One(b, projection_dim=128, predictor_hidden_dim=512,
                                       queue_size=q, **c),
}
#: Benchmark names that train a registered method with other settings -> its registry name.
VARIANTS = {"simclr_bank": "simclr", "dclw": "dcl"}
#: Methods that mask or order patch tokens: a small ViT (patch 4, width 64, 4 blocks) instead,
#: with these options.
VIT_METHODS: dict[str, dict] = {"msn": {}, "pmsn": {}, "simmim": {"mask_token": True},
                                "aim": {"pool": "mean"}}
#: Views per image of a method when it is not 2.
VIEWS = {"fastsiam": 4, "mmcr": 4, "msn": 3, "pmsn": 3,  # MSN: target, anchor, 1 focal
         "simmim": 1, "aim": 1,
         "ressl": 1}  # and a weak view (WEAK_VIEWS)
#: Weak views (crop + flip) appended after the others: ReSSL's teacher view.
WEAK_VIEWS = {"ressl": 1}


def _no_temperature(common: dict) -> dict:
    return {k: v for k, v in common.items() if k != "temperature"}


#: Images per class and split of ``--tiny``'s synthetic CIFAR-size image folder, and its batch
#: size (a power of two: it divides the recipes' queue sizes).
TINY_IMAGES_PER_CLASS, TINY_BATCH_SIZE = 2, 16


def write_tiny_images(root: Path, seed: int) -> None:
    """A synthetic CIFAR-10-layout image folder under ``root``: ``train/`` and ``test/``, 10
    classes of :data:`TINY_IMAGES_PER_CLASS` random 32 px PNG images each."""
    generator = torch.Generator().manual_seed(seed)
    for split in ("train", "test"):
        for label in range(10):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(TINY_IMAGES_PER_CLASS):
                pixels = torch.randint(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), generator=generator,
                                       dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{index}.png")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; ``--tiny`` on a synthetic image folder in a temporary directory."""
    args = parse_args(argv)
    if not args.tiny:
        return run(args)
    with tempfile.TemporaryDirectory(prefix="pretrain_knn_tiny_") as tmp:
        write_tiny_images(Path(tmp) / "cifar10", args.seed)
        return run(argparse.Namespace(
            **{**vars(args), "data_root": str(Path(tmp) / "cifar10"),
               "out": str(Path(tmp) / "run" / "last.ckpt"), "epochs": 1, "workers": 0,
               "batch_size": min(args.batch_size, TINY_BATCH_SIZE),
               "knn_bank": 10 * TINY_IMAGES_PER_CLASS, "limit_train_batches": 1}))


def run(args: argparse.Namespace) -> dict:
    """Measure kNN top-1 before and after pre-training ``args.method``; returns the result."""
    torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed)
    data = CIFAR10DataModule(
        root=args.data_root, batch_size=args.batch_size, num_workers=args.workers,
        persistent_workers=args.workers > 0, knn_train_subset=args.knn_bank, eval_batch_size=512,
        **build_views(args.method),  # type: ignore[arg-type]
    )
    model = build_method(args.method, args)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)

    def trainer(callbacks: list[pl.Callback], **kwargs: object) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out_dir,
            enable_progress_bar=False, callbacks=callbacks, **kwargs,  # type: ignore[arg-type]
        )

    start = time.perf_counter()
    knn = KNNCallback(k=min(200, args.knn_bank), temperature=0.07)
    random_top1 = trainer([knn]).validate(model, datamodule=data, verbose=False)[0]["val/knn_top1"]
    print(f"random init: kNN top-1 {random_top1:.2f}%  ({time.perf_counter() - start:.0f} s)",
          flush=True)

    start = time.perf_counter()
    probe = OnlineProbe(num_classes=10)
    fit = trainer([probe], max_epochs=args.epochs, max_time={"minutes": args.max_minutes},
                  limit_train_batches=args.limit_train_batches, limit_val_batches=0)
    fit.fit(model, datamodule=data)
    train_seconds = time.perf_counter() - start
    fit.save_checkpoint(args.out)
    pretrained = trainer([knn, probe]).validate(model, datamodule=data, verbose=False)[0]
    result = {
        "random_init_knn_top1": random_top1,
        "pretrained_knn_top1": pretrained["val/knn_top1"],
        "pretrained_knn_top5": pretrained["val/knn_top5"],
        "online_probe_top1": pretrained["val/probe_top1"],
        "epochs_done": round(fit.global_step / max(1, fit.num_training_batches), 2),
        "steps": fit.global_step,
        "train_minutes": round(train_seconds / 60, 1),
        "args": vars(args),
        "checkpoint": os.path.abspath(args.out),
    }
    print(json.dumps(result, indent=2))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
