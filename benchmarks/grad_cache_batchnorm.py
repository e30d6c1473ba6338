"""What micro-batching does to BatchNorm: kNN top-1 after the same short SimCLR run on CIFAR-10,
whole batches vs ``micro_batch_size`` (gradient caching), with BatchNorm in backbone and head.

With gradient caching the loss and its gradients are those of the whole batch, but BatchNorm
normalises each micro-batch with its own statistics (like per-device BN under DDP without
SyncBN), so BN networks train on a (slightly) different function. Both runs use the same seed,
data order, views, schedule and step budget; only ``micro_batch_size`` differs.

Run (CPU, one thread, a few minutes per variant with the defaults)::

    mkdir -p /work/data && tar -xzf ../shared/data/cifar10-jpeg.tar.gz -C /work/data
    python benchmarks/grad_cache_batchnorm.py --data-root /work/data/cifar10
"""

from __future__ import annotations

import argparse
import json
import time

import pytorch_lightning as pl
import torch
from torch import nn

from ssl_lightning.callbacks import KNNCallback
from ssl_lightning.data import CIFAR10DataModule, DeviceViews, UInt8Image
from ssl_lightning.methods import SimCLR


def bn_convnet(widths: tuple[int, ...]) -> nn.Module:
    """Conv-BN-ReLU stages (stride 2) and global average pooling; ``num_features`` set."""
    layers: list[nn.Module] = []
    channels = 3
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False),
                   nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        channels = width
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    net.num_features = channels  # type: ignore[assignment]
    return net


def run(args: argparse.Namespace, micro_batch_size: int | None) -> dict[str, float]:
    """Pre-train for ``args.steps`` steps, then the kNN top-1 on the test split."""
    pl.seed_everything(args.seed)
    data = CIFAR10DataModule(
        root=args.data_root, batch_size=args.batch_size, num_workers=0,
        knn_train_subset=args.knn_bank, eval_batch_size=512,
        train_transform=UInt8Image(), device_transform=DeviceViews(preset="cifar"),
    )
    model = SimCLR(bn_convnet(tuple(args.widths)), projection_hidden_dim=512,
                   projection_dim=128, head_batch_norm=True, temperature=0.2,
                   optimizer="lars", lr=1.0, warmup_epochs=0, micro_batch_size=micro_batch_size)
    settings = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_model_summary=False, enable_progress_bar=False,
                    num_sanity_val_steps=0)
    start = time.perf_counter()
    pl.Trainer(max_steps=args.steps, limit_val_batches=0, **settings).fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    knn = KNNCallback(k=200, temperature=0.07)
    metrics = pl.Trainer(callbacks=[knn], **settings).validate(model, datamodule=data,
                                                               verbose=False)[0]
    return {"knn_top1": metrics["val/knn_top1"], "train_seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", default="/work/data/cifar10")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--knn-bank", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"whole_batch": run(args, None), "micro_batches": run(args, args.micro_batch_size),
              "args": vars(args)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
