"""Plot TensorBoard scalars (e.g. the kNN accuracy curve of a pre-training run) as a PNG.

    python benchmarks/plot_scalars.py runs/simclr/version_0 --tags val/knn_top1 \
        --output docs/knn_curve.png

Needs matplotlib (``pip install ssl_lightning[plots]``).
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", help="folder with the events.out.tfevents file(s)")
    parser.add_argument("--tags", nargs="+", default=["val/knn_top1"])
    parser.add_argument("--output", required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    events = EventAccumulator(args.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=90)
    for tag in args.tags:
        points = events.Scalars(tag)
        ax.plot([p.step for p in points], [p.value for p in points], marker="o", label=tag)
        print(tag, [(p.step, round(p.value, 2)) for p in points])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output)


if __name__ == "__main__":
    main()
