"""Dense probes of one checkpoint on local datasets, printed as one table in the papers' format.

    python benchmarks/dense_probes.py --checkpoint runs/dinov2/version_0/checkpoints/last.ckpt \
        --seg-root data/ADEChallengeData2016 --seg-layout ade20k --num-classes 150 \
        --depth-root data/nyu --depth-layout nyu [--protocols seg_linear seg_knn depth_linear]

Runs the chosen protocols of :mod:`ssl_lightning.evaluation.dense` (the settings of
``configs/seg_linear.yaml``, ``seg_knn.yaml`` and ``depth_linear.yaml`` unless shrunk with
``--steps``, ``--crop-size``, ``--eval-size``) on the checkpoint's frozen backbone and prints
one row per protocol: segmentation mIoU (best head of the learning-rate grid, or best k), pixel
accuracy, and depth RMSE / AbsRel / δ1 of the best head, as DINOv2/DINOv3 and CAPI report them.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytorch_lightning as pl
import torch

from ssl_lightning.data.dense_pairs import DepthDataModule, SegmentationDataModule
from ssl_lightning.evaluation.dense import DenseKNNSegmentation, DepthLinearProbe, SegLinearProbe

PROTOCOLS = ("seg_linear", "seg_knn", "depth_linear")


def _trainer(args: argparse.Namespace, steps: int = 0) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator=args.accelerator, devices=1, logger=False,
                      enable_checkpointing=False, enable_model_summary=False,
                      enable_progress_bar=False,
                      check_val_every_n_epoch=None, val_check_interval=max(steps, 1),
                      num_sanity_val_steps=0)


def _data_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"batch_size": args.batch_size, "num_workers": args.num_workers,
            "crop_size": args.crop_size, "eval_size": args.eval_size}


def _best(results: dict[str, dict[str, torch.Tensor]], key: str, lowest: bool = False
          ) -> tuple[str, dict[str, float]]:
    name = (min if lowest else max)(results, key=lambda n: float(
        torch.nan_to_num(results[n][key], float("inf") if lowest else -1)))
    return name, {k: float(v) for k, v in results[name].items() if v.dim() == 0}


def run(args: argparse.Namespace, protocol: str) -> list[tuple[str, ...]]:
    """The table rows of one protocol."""
    probe_args = {"checkpoint": args.checkpoint, "checkpoint_prefix": args.prefix}
    if protocol == "depth_linear":
        data = DepthDataModule(args.depth_root, layout=args.depth_layout, bank_images=0,
                               resize_size=args.depth_resize, scale_range=(1.0, 1.0),
                               **_data_args(args))
        probe: Any = DepthLinearProbe(crop_size=args.crop_size, image_size=args.crop_size,
                                      **probe_args)
        trainer = _trainer(args, args.steps)
        trainer.fit(probe, data)
        head, s = _best(probe.results, "rmse", lowest=True)
        return [("linear depth (256 bins, SigLoss)", args.depth_layout, f"{s['rmse']:.3f}",
                 f"{s['abs_rel']:.3f}", f"{s['delta1']:.3f}", head)]
    data = SegmentationDataModule(args.seg_root, args.num_classes, layout=args.seg_layout,
                                  bank_images=None if protocol == "seg_knn" else 0,
                                  **_data_args(args))
    if protocol == "seg_knn":
        probe = DenseKNNSegmentation(num_classes=args.num_classes,
                                     patches_per_image=args.patches_per_image, **probe_args)
        _trainer(args).validate(probe, data, verbose=False)
        return [(f"dense kNN seg, k={name[1:]}", args.seg_layout, f"{float(s['miou']):.1f}",
                 f"{float(s['pixel_acc']):.1f}", "", "") for name, s in probe.results.items()]
    probe = SegLinearProbe(num_classes=args.num_classes, crop_size=args.crop_size,
                           image_size=args.crop_size, **probe_args)
    trainer = _trainer(args, args.steps)
    trainer.fit(probe, data)
    head, s = _best(probe.results, "miou")
    return [("linear seg (BN + 1x1 conv)", args.seg_layout, f"{s['miou']:.1f}",
             f"{s['pixel_acc']:.1f}", "", head)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a pre-training checkpoint of any ssl_lightning method")
    parser.add_argument("--prefix", default="backbone.", help="its backbone's state-dict prefix")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--seg-root")
    parser.add_argument("--seg-layout", default="ade20k",
                        choices=("ade20k", "voc", "cityscapes", "folders"))
    parser.add_argument("--num-classes", type=int, default=150)
    parser.add_argument("--depth-root")
    parser.add_argument("--depth-layout", default="nyu", choices=("nyu", "folders"))
    parser.add_argument("--depth-resize", type=int, default=480)
    parser.add_argument("--steps", type=int, default=40_000, help="training steps of a probe")
    parser.add_argument("--crop-size", type=int, default=512)
    parser.add_argument("--eval-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--patches-per-image", type=int, default=100)
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()
    for protocol in args.protocols:
        root = args.depth_root if protocol.startswith("depth") else args.seg_root
        if root is None:
            parser.error(f"{protocol} needs --{'depth' if protocol.startswith('depth') else 'seg'}"
                         "-root")
    pl.seed_everything(0)
    rows = [row for protocol in args.protocols for row in run(args, protocol)]
    header = ("protocol", "dataset", "mIoU / RMSE", "pix.acc / AbsRel", "δ1", "best head")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\ncheckpoint: {args.checkpoint}")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
