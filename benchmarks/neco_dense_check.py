"""A CPU pipeline check of NeCo against its starting checkpoint with the dense probes, and a
start of ``configs/neco.yaml`` from a file of the released DINOv2 ViT-S/14 shape: not an
accuracy claim.

    python benchmarks/neco_dense_check.py --out /tmp/neco_dense \
        --start runs/dino_vit/version_0/checkpoints/last.ckpt --steps 60
    python benchmarks/dense_probes.py --checkpoint /tmp/neco_dense/neco.ckpt \
        --seg-root /tmp/neco_dense/seg --seg-layout folders --num-classes 4 \
        --protocols seg_linear seg_knn --steps 100 --crop-size 32 --eval-size 32 \
        --batch-size 16 --num-workers 0 --patches-per-image 16 --accelerator cpu
    (the same on the --start checkpoint)
    python benchmarks/neco_dense_check.py --out /tmp/neco_dinov2 --dinov2-start

The check writes the synthetic labelled segmentation set of ``tests/dense_utils.py`` (coloured
squares on a background, 4 classes, 32 px) under ``--out/seg``. It post-trains the ViT of
``--start`` (a ``.ckpt`` of any ssl_lightning method whose backbone is a ViT; its student's
``backbone.*`` weights become ``pretrained_path``) with ``configs/neco.yaml`` through the real CLI,
for ``--steps`` steps of batch 32 on the set's training images (``LocatedViews`` at 32 px). Only
the backbone's shape, the projection width, the grid and the learning rate are shrunk. It then
saves the final weights to ``--out/neco.ckpt`` for ``benchmarks/dense_probes.py``.

``--dinov2-start`` writes random weights under the exact keys and shapes of the released
``dinov2_vits14_reg4_pretrain.pth`` (``--registers 0``: ``dinov2_vits14_pretrain.pth``). These
are ViT-S/14 with a 37 x 37 position table for 518 px, LayerScale, and a (1, 384) mask token. It
then runs the shipped config unchanged on them for 2 steps of batch 2 at 224 px: the position
table is interpolated to 16 x 16, student and teacher start from the file, and the loss is
finite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ssl_lightning.backbones.checkpoint import SPEC_KEY, load_checkpoint
from ssl_lightning.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from dense_utils import make_segmentation_folder  # noqa: E402

#: The released DINOv2 ViT-S/14: width, blocks, MLP width, patch, position-table side (518 px).
DINOV2_S14 = {"dim": 384, "depth": 12, "hidden": 1536, "patch": 14, "grid": 37}


def dinov2_vits14_state(registers: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the key names and shapes of the released ``dinov2_vits14``
    (``registers=0``) or ``dinov2_vits14_reg4`` (``registers=4``) ``*_pretrain.pth`` files (the
    official ``DinoVisionTransformer``, no block chunks), drawn like trained values: small
    weights, LayerScale near 1e-5..1, LayerNorm weights near 1."""
    d, hidden, patch, grid = (DINOV2_S14[k] for k in ("dim", "hidden", "patch", "grid"))
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    state = {"cls_token": randn(1, 1, d), "pos_embed": randn(1, 1 + grid * grid, d),
             "mask_token": torch.zeros(1, d),
             "patch_embed.proj.weight": randn(d, 3, patch, patch),
             "patch_embed.proj.bias": randn(d)}
    if registers:
        state["register_tokens"] = randn(1, registers, d)
    for i in range(DINOV2_S14["depth"]):
        block = f"blocks.{i}."
        state.update({
            block + "norm1.weight": 1 + randn(d), block + "norm1.bias": randn(d),
            block + "attn.qkv.weight": randn(3 * d, d), block + "attn.qkv.bias": randn(3 * d),
            block + "attn.proj.weight": randn(d, d), block + "attn.proj.bias": randn(d),
            block + "ls1.gamma": randn(d, scale=0.1).abs(),
            block + "norm2.weight": 1 + randn(d), block + "norm2.bias": randn(d),
            block + "mlp.fc1.weight": randn(hidden, d), block + "mlp.fc1.bias": randn(hidden),
            block + "mlp.fc2.weight": randn(d, hidden), block + "mlp.fc2.bias": randn(d),
            block + "ls2.gamma": randn(d, scale=0.1).abs()})
    state.update({"norm.weight": 1 + randn(d), "norm.bias": randn(d)})
    return state


def neco_fit(out: Path, images: Path, steps: int, batch_size: int, extra: list[str],
             save: Path | None = None) -> None:
    """``fit --config configs/neco.yaml`` on the images of ``images``; the final weights are
    saved to ``save``."""
    run_dir = out / "run"
    cli = cli_main([
        "fit", "--config", str(ROOT / "configs" / "neco.yaml"),
        "--data.train_dir", str(images), "--data.val_dir", "null",
        "--data.batch_size", str(batch_size), "--data.num_workers", "0",
        "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1",
        "--trainer.logger", "false", "--trainer.default_root_dir", str(run_dir),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", *extra])
    loss = float(cli.trainer.callback_metrics.get("train/loss", math.nan))
    print(f"NeCo: {cli.trainer.global_step} steps, last train/loss {loss:.4f}", flush=True)
    if not math.isfinite(loss):
        raise SystemExit(f"error: NeCo's loss is {loss} after {cli.trainer.global_step} steps.")
    if save is not None:
        cli.trainer.save_checkpoint(save)
        print(f"saved {save}", flush=True)


def post_train(args: argparse.Namespace, out: Path) -> None:
    """NeCo from ``--start`` (a 32 px ViT of patch 4) on the synthetic set's training images."""
    spec = load_checkpoint(args.start)[SPEC_KEY]
    vit = spec["init_args"]
    # one JSON value: the dotted flags cannot set an optional argument (layer_scale_init) to null
    backbone = ["--model.backbone", json.dumps({"class_path": spec["class_path"], "init_args": {
        **{name: vit.get(name) for name in (
            "image_size", "patch_size", "embed_dim", "depth", "num_heads", "num_registers",
            "layer_scale_init", "pos_embed", "mlp", "norm_eps", "qkv_bias", "mlp_ratio")},
        "drop_path_rate": 0.0, "pretrained_path": args.start}})]
    neco_fit(out, out / "seg" / "train" / "images", args.steps, 32, [
        *backbone, "--model.image_size", str(vit["image_size"]),
        "--model.projection_hidden_dim", "256", "--model.projection_dim", "64",
        "--model.grid", "4", "--model.lr", str(args.lr),
        "--data.preset", "cifar", "--data.train_transform.init_args.preset", "cifar",
        "--data.train_transform.init_args.crop_size", str(vit["image_size"])],
        save=out / "neco.ckpt")


def dinov2_start(args: argparse.Namespace, out: Path) -> None:
    """The shipped config, unchanged, from a file of the released DINOv2 ViT-S/14 shape."""
    name = "dinov2_vits14_reg4_pretrain.pth" if args.registers else "dinov2_vits14_pretrain.pth"
    path = out / name
    torch.save(dinov2_vits14_state(args.registers), path)
    extra = [f"--model.backbone.init_args.pretrained_path={path}",
             f"--model.backbone.init_args.num_registers={args.registers}"]
    neco_fit(out, out / "seg" / "train" / "images", 2, 2, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--start", help="the starting checkpoint (a ViT of any method)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW, not scaled")
    parser.add_argument("--images", type=int, default=256, help="training images")
    parser.add_argument("--dinov2-start", action="store_true",
                        help="start the shipped config from a released-shape DINOv2 file")
    parser.add_argument("--registers", type=int, default=4, choices=(0, 4))
    args = parser.parse_args()
    if not args.dinov2_start and args.start is None:
        parser.error("give --start CHECKPOINT (or --dinov2-start)")
    out = Path(args.out)
    if not (out / "seg").exists():
        make_segmentation_folder(out / "seg", classes=4, train=args.images, val=32, size=32)
    sys.argv = sys.argv[:1]  # the CLI reads only the arguments it is given
    if args.dinov2_start:
        dinov2_start(args, out)
    else:
        post_train(args, out)


if __name__ == "__main__":
    main()
