"""Images/s of ``python -m ssl_lightning embed`` on CPU, decode and transform included.

``PYTHONPATH=. python benchmarks/embed_speed.py --checkpoint CKPT --images data/cifar10/test``

Runs the real command (all images under ``--images``) once per ``--batch-size`` / ``--workers``
setting, in this process, and prints images/s for each, plus the t-SNE and UMAP pictures of the
embeddings when ``--pictures DIR`` is given (the README's pictures).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pictures", default=None, help="folder for t-SNE/UMAP PNGs")
    parser.add_argument("--picture-samples", type=int, default=2000)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    from ssl_lightning.evaluation.embed import embed_folder

    with tempfile.TemporaryDirectory() as tmp:
        for workers in ns.workers:
            out = str(Path(tmp) / f"emb_{workers}.npy")
            start = time.perf_counter()
            result = embed_folder(ns.checkpoint, ns.images, out, batch_size=ns.batch_size,
                                  num_workers=workers)
            seconds = time.perf_counter() - start
            print(f"workers={workers} threads={ns.threads} batch={ns.batch_size}: "
                  f"{result['rows']} images in {seconds:.1f} s = "
                  f"{result['rows'] / seconds:.0f} img/s")
        if ns.pictures:
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
