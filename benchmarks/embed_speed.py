"""Images/s of ``python -m ssl_lightning embed`` on CPU, decode and transform included, against
the same embedding written as a plain PyTorch loop.

``PYTHONPATH=. python benchmarks/embed_speed.py --checkpoint CKPT --images data/cifar10/test``

Runs the real command (all images under ``--images``) once per ``--workers`` setting, in this
process, and the plain loop (torchvision's ``ImageFolder`` with the checkpoint's eval transform,
a ``DataLoader`` of the same batch size, the backbone under ``torch.inference_mode``, the rows
saved with ``numpy.save``) with 0 workers; prints images/s for each, plus the t-SNE and UMAP
pictures of the embeddings when ``--pictures DIR`` is given (the README's pictures).
``make_checkpoint`` writes a SimCLR ResNet-18 checkpoint trained one step on the images
(the suite uses it when it has no checkpoint).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_checkpoint(images: str, folder: str) -> str:
    """A SimCLR ResNet-18 (CIFAR stem) checkpoint trained one step on ``images``, in
    ``folder``."""
    from ssl_lightning._lightning import pl
    from ssl_lightning.backbones import ResNet
    from ssl_lightning.data import ImageFolderDataModule, SimCLRViews
    from ssl_lightning.methods import SimCLR

    torch.manual_seed(0)
    data = ImageFolderDataModule(images, preset="cifar", train_transform=SimCLRViews("cifar"),
                                 batch_size=8, num_workers=0, persistent_workers=False,
                                 pin_memory=False)
    model = SimCLR(ResNet(18, cifar_stem=True), optimizer="sgd", lr=0.1, lr_scaling="none",
                   warmup_epochs=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    path = str(Path(folder) / "simclr.ckpt")
    trainer.save_checkpoint(path)
    return path


def plain_loop(checkpoint: str, images: str, output: str, batch_size: int) -> int:
    """The embedding as a plain PyTorch loop; the number of rows written to ``output``."""
    from torchvision.datasets import ImageFolder

    from ssl_lightning.data.preprocessing import eval_transform
    from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint
    from ssl_lightning.evaluation.preprocessing import checkpoint_preprocessing

    transform = eval_transform(checkpoint_preprocessing(checkpoint, "embed"))
    backbone = backbone_from_checkpoint(checkpoint).eval()
    loader = torch.utils.data.DataLoader(ImageFolder(images, transform), batch_size=batch_size)
    rows = []
    with torch.inference_mode():
        for x, _ in loader:
            rows.append(backbone(x).numpy())
    np.save(output, np.concatenate(rows))
    return sum(len(r) for r in rows)


def measure(checkpoint: str, images: str, batch_size: int = 256, rounds: int = 1,
            workers: tuple[int, ...] = (0,)) -> dict[str, float]:
    """Median images/s over ``rounds`` alternating rounds: ``embed`` per worker count
    (``"embed, {w} workers"``) and the plain loop (``"plain PyTorch loop"``)."""
    from ssl_lightning.evaluation.embed import embed_folder

    rates: dict[str, list[float]] = {f"embed, {w} workers": [] for w in workers}
    rates["plain PyTorch loop"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for w in workers:
                start = time.perf_counter()
                result = embed_folder(checkpoint, images, str(Path(tmp) / f"emb_{w}.npy"),
                                      batch_size=batch_size, num_workers=w)
                rates[f"embed, {w} workers"].append(result["rows"] / (time.perf_counter() - start))
            start = time.perf_counter()
            rows = plain_loop(checkpoint, images, str(Path(tmp) / "plain.npy"), batch_size)
            rates["plain PyTorch loop"].append(rows / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pictures", default=None, help="folder for t-SNE/UMAP PNGs")
    parser.add_argument("--picture-samples", type=int, default=2000)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    rates = measure(ns.checkpoint, ns.images, ns.batch_size, ns.rounds, tuple(ns.workers))
    for name, rate in rates.items():
        print(f"{name} (threads={ns.threads}, batch={ns.batch_size}): {rate:.0f} img/s")
    if ns.pictures:
        from ssl_lightning.evaluation.embed import embed_folder

        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "emb.npy")
            embed_folder(ns.checkpoint, ns.images, out, batch_size=ns.batch_size)
            draw(out, ns.pictures, ns.picture_samples)


def draw(npy: str, folder: str, samples: int) -> None:
    """t-SNE and UMAP pictures of a random subset of the embeddings in ``npy``."""
    import numpy as np
    from PIL import Image

    from ssl_lightning.evaluation.embed_writers import read_sidecar
    from ssl_lightning.evaluation.embedding_plot import plot_embeddings
    from ssl_lightning.evaluation.projection import project_2d

    features = torch.from_numpy(np.load(npy))
    labels = torch.from_numpy(read_sidecar(npy)[1])
    subset = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[:samples]
    Path(folder).mkdir(parents=True, exist_ok=True)
    for method, title in (("tsne", "t-SNE"), ("umap", "UMAP")):
        start = time.perf_counter()
        points = project_2d(features[subset], method)  # type: ignore[arg-type]
        image = plot_embeddings(points, labels[subset],
                                f"{title} of CIFAR-10 test embeddings (n={samples})",
                                axis_label=title)
        path = Path(folder) / f"embeddings_{method}.png"
        Image.fromarray(image).save(path)
        print(f"{title}: {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
