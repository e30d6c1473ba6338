"""Cost of the per-batch reseeding of the model-side randomness (``SeededSteps.reseed_rng``),
next to its parts and to ``torch.manual_seed`` (iBOT's former per-batch call), on CPU.

Usage:
    python benchmarks/reseed_cost.py --calls 20000 --repeats 5

Prints the best of ``--repeats`` timings of ``--calls`` calls each, in microseconds per call.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from ssl_lightning.backbones import ViT
from ssl_lightning.methods import DINO
from ssl_lightning.training.step_rng import step_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = DINO(ViT(image_size=16, patch_size=4, embed_dim=8, depth=2, num_heads=2),
                 head_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4)
    cases = {
        "SeededSteps.reseed_rng (per training batch)": lambda: model.reseed_rng(5),
        "  step_seed": lambda: step_seed(0, 1, 5, 0),
        "  torch.default_generator.manual_seed": lambda: torch.default_generator.manual_seed(5),
        "torch.manual_seed (iBOT's former call)": lambda: torch.manual_seed(5),
    }
    for name, call in cases.items():
        best = min(timeit.repeat(call, number=args.calls, repeat=args.repeats)) / args.calls
        print(f"{name}: {best * 1e6:.1f} us")


if __name__ == "__main__":
    main()
