"""A CPU pipeline check of DetCon-S / DetCon-B next to SimCLR / BYOL, and of PixPro next to
BYOL, with the dense probes: not an accuracy claim.

    python benchmarks/detcon_dense_check.py --out /tmp/detcon_dense --steps 100 \
        [--methods detcon_s_fh detcon_b_fh]
    python benchmarks/detcon_dense_check.py --out /tmp/pixpro_dense --methods byol pixpro
    python benchmarks/dense_probes.py --checkpoint /tmp/detcon_dense/detcon_s.ckpt \
        --seg-root /tmp/detcon_dense/seg --seg-layout folders --num-classes 4 \
        --protocols seg_linear seg_knn --steps 100 --crop-size 32 --eval-size 32 \
        --batch-size 16 --num-workers 0 --patches-per-image 16 --accelerator cpu

Writes the synthetic labelled segmentation set of ``tests/dense_utils.py`` (coloured squares on
a background, 4 classes, 32 px) under ``--out/seg``, pretrains ``SmallConvNet((16, 32))`` with
each method's small heads for ``--steps`` SGD steps of batch 16 (lr 0.02) on its training images
(``LocatedViews``: the SimCLR views and their crop boxes; SimCLR and BYOL get the views only;
the ``_fh`` variants: ``FelzenszwalbViews`` with scale 100, min size 10 px, chosen here for 32 px
images, and 16 sampled masks per view; ``--methods`` picks some), and saves one checkpoint per
method for ``benchmarks/dense_probes.py``. The set is trivial (a
pixel's class is its colour), so the numbers check that pretraining, checkpoints and both dense
probes run end to end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data.dense_pairs import IMAGENET_MEAN, IMAGENET_STD
from ssl_lightning.data.located_views import LocatedViews
from ssl_lightning.data.segmented_views import FelzenszwalbViews
from ssl_lightning.methods import BYOL, DetConB, DetConS, PixPro, SimCLR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dense_utils import make_segmentation_folder  # noqa: E402

SIZE = 32
#: The methods pretrained here, in order.
METHODS = ("simclr", "detcon_s", "byol", "detcon_b", "pixpro", "detcon_s_fh", "detcon_b_fh")


class LocatedImages(Dataset):
    """The training images of the synthetic set as located views: ``entries`` "views" (boxes
    dropped), "boxes" or "felzenszwalb" (the views and their Felzenszwalb segment maps)."""

    def __init__(self, folder: Path, entries: str) -> None:
        self.paths = sorted((folder / "train" / "images").glob("*.png"))
        views: dict[str, Any] = dict(preset="cifar", crop_size=SIZE, crop_scale=(0.2, 1.0),
                                     mean=IMAGENET_MEAN, std=IMAGENET_STD)
        self.transform = (FelzenszwalbViews(**views, scale=100.0, min_size=10)
                          if entries == "felzenszwalb" else LocatedViews(**views))
        self.boxes = entries != "views"

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        views = self.transform(Image.open(self.paths[i]).convert("RGB"))
        return (views if self.boxes else views[:2]), 0


def methods() -> dict[str, tuple[pl.LightningModule, str]]:
    common: dict[str, Any] = dict(image_size=SIZE, optimizer="sgd", lr=0.02, lr_scaling="none",
                                  warmup_epochs=0)
    heads = dict(projection_hidden_dim=64, projection_dim=32, head_batch_norm=False)
    return {
        "simclr": (SimCLR(SmallConvNet((16, 32)), **heads, **common), "views"),
        "detcon_s": (DetConS(SmallConvNet((16, 32)), grid=4, segment_image_size=SIZE,
                             **heads, **common), "boxes"),
        "byol": (BYOL(SmallConvNet((16, 32)), momentum_base=0.99, **heads, **common), "views"),
        "detcon_b": (DetConB(SmallConvNet((16, 32)), grid=4, segment_image_size=SIZE,
                             momentum_base=0.99, **heads, **common), "boxes"),
        "pixpro": (PixPro(SmallConvNet((16, 32)), momentum_base=0.99, **heads, **common),
                   "boxes"),
        "detcon_s_fh": (DetConS(SmallConvNet((16, 32)), sampled_masks=16, **heads, **common),
                        "felzenszwalb"),
        "detcon_b_fh": (DetConB(SmallConvNet((16, 32)), sampled_masks=16, momentum_base=0.99,
                                **heads, **common), "felzenszwalb"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--images", type=int, default=64, help="training images")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                        help="methods to pretrain (default: all)")
    args = parser.parse_args()
    out = Path(args.out)
    make_segmentation_folder(out / "seg", classes=4, train=args.images, val=32, size=SIZE)
    for name, (model, entries) in methods().items():
        if args.methods is not None and name not in args.methods:
            continue
        pretrain_and_save(name, model, LocatedImages(out / "seg", entries), out, args.steps)


def pretrain_and_save(name: str, model: pl.LightningModule, images: Dataset, out: Path,
                      steps: int) -> None:
    """``steps`` steps of batch 16 from seed 0, then ``out/<name>.ckpt`` and its last loss."""
    pl.seed_everything(0)
    loader = DataLoader(images, batch_size=16, shuffle=True, drop_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=False,
                         num_sanity_val_steps=0, max_steps=steps)
    trainer.fit(model, loader)
    trainer.save_checkpoint(out / f"{name}.ckpt")
    print(f"{name}: saved {out / f'{name}.ckpt'}; last loss "
          f"{float(trainer.callback_metrics.get('train/loss', 0)):.4f}", flush=True)


if __name__ == "__main__":
    main()
