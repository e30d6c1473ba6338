"""Multi-crop DINO / SwAV training steps on one device: throughput, grouped vs per-crop backbone
calls, and mixed-precision sanity (loss finite, DINO centre and Sinkhorn kept in fp32).

    python benchmarks/multicrop_step.py                 # GPU: ViT-S/16 DINO, ResNet-50 SwAV
    python benchmarks/multicrop_step.py --tiny          # CPU smoke run with tiny sizes

Prints one line per measurement. Timings use CUDA events after warm-up steps.
"""

from __future__ import annotations

import argparse
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ssl_lightning.backbones import ResNet, SmallConvNet, ViT
from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.losses import DINOLoss, SwAVLoss
from ssl_lightning.methods import DINO, SwAV


class FixedViews(Dataset):
    """``n`` samples of fixed random multi-crop views."""

    def __init__(self, n: int, sizes: list[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.views = [torch.randn(n, 3, s, s, generator=g) for s in sizes]

    def __len__(self) -> int:
        return self.views[0].shape[0]

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return [v[i] for v in self.views], torch.tensor(-1)


class StepTimer(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.start = warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self.start)


def fit(model, sizes, batch, steps, precision, accelerator):  # type: ignore[no-untyped-def]
    timer = StepTimer(warmup=3)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_steps=steps, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer])
    loader = DataLoader(FixedViews(batch * steps, sizes), batch_size=batch, drop_last=True)
    trainer.fit(model, loader)
    loss = float(trainer.callback_metrics["train/loss_step"])
    return loss, sum(timer.times) / max(1, len(timer.times))


def time_backbone(backbone, views, grouped: bool, reps: int) -> float:  # type: ignore[no-untyped-def]
    def once() -> None:
        with torch.autocast(views[0].device.type, dtype=torch.bfloat16):
            out = (forward_by_resolution(backbone, views) if grouped
                   else torch.cat([backbone(v) for v in views]))
        out.float().sum().backward()

    for _ in range(2):
        once()
    if views[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    if views[0].is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def autocast_losses(device: str) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    student = [torch.randn(64, 4096, generator=g).to(device) for _ in range(8)]
    teacher = student[:2]
    scores = [torch.nn.functional.normalize(torch.randn(64, 3000, generator=g), dim=1).to(device)
              for _ in range(8)]
    for dtype in (torch.bfloat16, torch.float16):
        low = [s.to(dtype) for s in student]
        ref = DINOLoss(4096).to(device)([s.float() for s in low], [t.float() for t in low[:2]],
                                        0.04)
        dino = DINOLoss(4096).to(device)
        with torch.autocast(device, dtype=dtype):
            got = dino(low, low[:2], 0.04)
        swav_ref = SwAVLoss()([s.to(dtype).float() for s in scores])
        with torch.autocast(device, dtype=dtype):
            swav = SwAVLoss()([s.to(dtype) for s in scores])
        print(f"autocast {dtype}: dino |diff|={abs(got - ref).item():.2e} dtype={got.dtype} "
              f"centre={dino.center.dtype}; swav |diff|={abs(swav - swav_ref).item():.2e} "
              f"dtype={swav.dtype}")
    del teacher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="tiny CPU smoke run")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, accelerator = ("cuda", "gpu") if cuda else ("cpu", "cpu")
    precision = "bf16-mixed"
    if args.tiny:
        batch, steps, g, loc, n_local = 4, 5, 32, 16, 2
        vit = lambda: ViT(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)  # noqa: E731
        cnn = lambda: SmallConvNet((8, 16))  # noqa: E731
    else:
        batch, steps, g, loc, n_local = 64, 15, 224, 96, 10
        vit = lambda: ViT("small", image_size=224, patch_size=16, drop_path_rate=0.1)  # noqa: E731
        cnn = lambda: ResNet(50)  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device={name} torch={torch.__version__}")
    autocast_losses(device)

    sizes = [g, g] + [loc] * n_local
    dino = DINO(vit(), head_out_dim=65536, optimizer="adamw", lr=5e-4, weight_decay=0.04,
                weight_decay_end=0.4, warmup_epochs=0, lr_scaling="none")
    loss, step = fit(dino, sizes, batch, steps, precision, accelerator)
    print(f"DINO ViT-S/16 2x{g}+{n_local}x{loc} batch {batch} {precision}: loss {loss:.4f}, "
          f"{step * 1e3:.1f} ms/step, {batch / step:.0f} img/s, "
          f"centre {dino.criterion.center.dtype}")

    sizes_swav = [g, g] + [loc] * 6
    swav = SwAV(cnn(), num_prototypes=3000, freeze_prototypes_steps=2, warmup_epochs=0,
                lr=0.6, queue_size=batch * 2, queue_start_epoch=0)
    loss, step = fit(swav, sizes_swav, batch, steps, precision, accelerator)
    print(f"SwAV {type(swav.backbone).__name__} 2x{g}+6x{loc} batch {batch} {precision}: loss "
          f"{loss:.4f}, {step * 1e3:.1f} ms/step, {batch / step:.0f} img/s, queue filled "
          f"{int(swav.queue_filled)}")

    backbone = vit().to(device)
    views = [torch.randn(batch, 3, s, s, device=device) for s in sizes]
    for grouped in (True, False):
        t = time_backbone(backbone, views, grouped, reps=3 if args.tiny else 10)
        how = "grouped (2 calls)" if grouped else f"per crop ({len(views)} calls)"
        print(f"ViT backbone fwd+bwd bf16, {len(views)} crops, {how}: {t * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
