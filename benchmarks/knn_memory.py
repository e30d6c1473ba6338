"""Peak memory of the offline kNN evaluation at CIFAR scale (50,000 bank × 10,000 queries).

    python benchmarks/knn_memory.py [--dim 512] [--chunk-size 512]

Runs :func:`ssl_lightning.callbacks.knn.knn_predict` (the code behind ``KNNCallback`` and
``KNNEval``) on random features and reports the growth of the process's peak RSS over the
features themselves, next to the size of the dense 10,000 × 50,000 similarity matrix that an
unchunked implementation would hold.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from ssl_lightning.callbacks.knn import knn_predict


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bank", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(args.bank, args.dim, generator=g)
    labels = torch.randint(10, (args.bank,), generator=g)
    queries = torch.randn(args.queries, args.dim, generator=g)
    knn_predict(bank[:1000], labels[:1000], queries[:10], 10)  # warm-up allocations
    before = peak_rss_mb()
    start = time.perf_counter()
    scores = knn_predict(bank, labels, queries, 10, k=200, temperature=0.07,
                         chunk_size=args.chunk_size)
    seconds = time.perf_counter() - start
    dense_mb = args.bank * args.queries * 4 / 2**20
    print(f"bank {args.bank} x queries {args.queries} x dim {args.dim}, chunk {args.chunk_size}: "
          f"peak RSS +{peak_rss_mb() - before:.0f} MB over the features "
          f"({(bank.numel() + queries.numel()) * 4 / 2**20:.0f} MB); dense similarity matrix "
          f"would be {dense_mb:.0f} MB; {seconds:.1f} s on {args.threads} thread(s); "
          f"scores {tuple(scores.shape)}")


if __name__ == "__main__":
    main()
