"""A CPU pipeline check of CrIBo next to DINO (its global counterpart) with the dense probes: not
an accuracy claim.

    python benchmarks/cribo_dense_check.py --out /tmp/cribo_dense --steps 100
    python benchmarks/dense_probes.py --checkpoint /tmp/cribo_dense/cribo.ckpt \
        --seg-root /tmp/cribo_dense/seg --seg-layout folders --num-classes 4 \
        --protocols seg_linear seg_knn --steps 100 --crop-size 32 --eval-size 32 \
        --batch-size 16 --num-workers 0 --patches-per-image 16 --accelerator cpu

Writes the synthetic labelled segmentation set of ``tests/dense_utils.py`` (coloured squares on
a background, 4 classes, 32 px) under ``--out/seg``, pretrains the same small ViT (2 blocks of
width 32, 4 px patches: an 8 x 8 grid) with DINO and with CrIBo (the same [CLS] head widths;
CrIBo adds 8 objects per image, a 256-image bank and the cross-image term from step 0) for
``--steps`` AdamW steps of batch 16 on two SimCLR views of its training images
(:class:`detcon_dense_check.LocatedImages` without the boxes), and saves one checkpoint per
method for ``benchmarks/dense_probes.py``. The set is trivial (a pixel's class is its colour),
so the numbers check that pretraining, checkpoints and both dense probes run end to end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import DINO, CrIBo

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dense_utils import make_segmentation_folder  # noqa: E402
from detcon_dense_check import SIZE, LocatedImages, pretrain_and_save  # noqa: E402


def backbone() -> ViT:
    return ViT(image_size=SIZE, patch_size=4, embed_dim=32, depth=2, num_heads=4)


def methods() -> dict[str, Any]:
    common: dict[str, Any] = dict(
        image_size=SIZE, optimizer="adamw", lr=1e-3, lr_scaling="none", warmup_epochs=0,
        weight_decay=0.04, head_out_dim=256, head_hidden_dim=128, head_bottleneck_dim=64,
        warmup_teacher_temperature_epochs=0, momentum_base=0.99, clip_grad=3.0,
        freeze_last_layer_epochs=0)
    return {
        "dino": DINO(backbone(), **common),
        "cribo": CrIBo(backbone(), object_out_dim=256, num_objects=8, queue_size=256,
                       cross_image_start_epoch=0, **common),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--images", type=int, default=64, help="training images")
    args = parser.parse_args()
    out = Path(args.out)
    make_segmentation_folder(out / "seg", classes=4, train=args.images, val=32, size=SIZE)
    for name, model in methods().items():
        pretrain_and_save(name, model, LocatedImages(out / "seg", "views"), out, args.steps)


if __name__ == "__main__":
    main()
