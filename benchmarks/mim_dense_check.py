"""A CPU pipeline check of masked-image methods with the dense probes: not an accuracy claim.

    python benchmarks/mim_dense_check.py --out /tmp/mim_dense --steps 150
    python benchmarks/dense_probes.py --checkpoint /tmp/mim_dense/pixio.ckpt \
        --seg-root /tmp/mim_dense/seg --seg-layout folders --num-classes 4 \
        --protocols seg_linear seg_knn --steps 100 --crop-size 32 --eval-size 32 \
        --batch-size 16 --num-workers 0 --patches-per-image 16 --accelerator cpu
        [--prefix teacher_backbone. for CAPI]

Writes a synthetic labelled segmentation set (``tests/dense_utils.py``: coloured squares on a
background, 4 classes, 32 px) under ``--out/seg``, pretrains the same small ViT (4 blocks of
width 64, 4 px patches) with each method for ``--steps`` steps of batch 32 (AdamW, lr 1e-3) on
its training images (flips only), and saves one checkpoint per method (``random``: the initial
weights) for ``benchmarks/dense_probes.py``. The set is trivial (a pixel's class is its
colour), so the numbers check that pretraining, checkpoints and both dense probes run end to
end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ssl_lightning.backbones import ViT
from ssl_lightning.data.dense_pairs import IMAGENET_MEAN, IMAGENET_STD
from ssl_lightning.methods import CAPI, MAE, Pixio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dense_utils import make_segmentation_folder  # noqa: E402

SIZE = 32


class FlippedImages(Dataset):
    """The training images of the synthetic set as one randomly flipped view each."""

    def __init__(self, folder: Path) -> None:
        mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
        std = torch.tensor(IMAGENET_STD)[:, None, None]
        self.images = [(torch.from_numpy(np.asarray(Image.open(p), dtype=np.float32) / 255)
                        .permute(2, 0, 1) - mean) / std
                       for p in sorted((folder / "train" / "images").glob("*.png"))]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        image = self.images[i]
        return [image.flip(-1) if torch.rand(()) < 0.5 else image], 0


def vit(**kwargs: Any) -> ViT:
    return ViT(image_size=SIZE, patch_size=4, embed_dim=64, depth=4, num_heads=4, **kwargs)


def methods() -> dict[str, pl.LightningModule]:
    common = dict(image_size=SIZE, lr=1e-3, lr_scaling="none", warmup_epochs=0)
    return {
        "random": MAE(vit(), decoder_dim=64, decoder_depth=2, decoder_heads=4, **common),
        "mae": MAE(vit(), decoder_dim=64, decoder_depth=2, decoder_heads=4, **common),
        "pixio": Pixio(vit(num_registers=7, pool="prefix"), mask_grid=2, decoder_dim=64,
                       decoder_depth=4, decoder_heads=4, **common),
        "capi": CAPI(vit(num_registers=3, pool="mean"), num_clusters=64, predictor_dim=64,
                     predictor_depth=2, predictor_heads=4, prediction_subsampling=0.25,
                     momentum_base=0.99, **common),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--images", type=int, default=256, help="training images")
    args = parser.parse_args()
    out = Path(args.out)
    make_segmentation_folder(out / "seg", classes=4, train=args.images, val=32, size=SIZE)
    for name, model in methods().items():
        pl.seed_everything(0)
        loader = DataLoader(FlippedImages(out / "seg"), batch_size=32, shuffle=True,
                            drop_last=True)
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_model_summary=False,
                             enable_progress_bar=False, num_sanity_val_steps=0,
                             max_steps=1 if name == "random" else args.steps)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer.fit(model, loader)
        if name == "random":  # one step attaches the trainer; keep the initial weights
            model.load_state_dict(initial)
        trainer.save_checkpoint(out / f"{name}.ckpt")
        moved = sum(float((v - initial[k]).norm() ** 2) for k, v in model.state_dict().items()
                    if k.startswith("backbone.") and v.is_floating_point()) ** 0.5
        norm = sum(float(v.norm() ** 2) for k, v in initial.items()
                   if k.startswith("backbone.") and v.is_floating_point()) ** 0.5
        print(f"{name}: saved {out / f'{name}.ckpt'}; backbone moved by {moved / norm:.3f} of "
              f"its norm; last loss {float(trainer.callback_metrics.get('train/loss', 0)):.4f}",
              flush=True)


if __name__ == "__main__":
    main()
