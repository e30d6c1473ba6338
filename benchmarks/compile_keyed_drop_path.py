"""``torch.compile`` of a ViT with keyed stochastic depth: the same drop decisions as eager, and
the step time of each, side by side in one run (CPU, one thread by default).

Inside :func:`~ssl_lightning.training.sample_rng.keyed_forward` every ``DropPath`` draws its
rows' keep decisions from the samples' keys and a per-forward call counter (Python state that
the compiled graph must not freeze). The script runs the same forward and backward eagerly and
compiled over ``--steps`` steps with new keys at each step, prints the largest difference of
the outputs and of the gradients (fp32 kernel noise when the decisions agree; a frozen decision
shows as an O(1) difference), and the median step time of each after the first compiled step.

Usage:
    python benchmarks/compile_keyed_drop_path.py --steps 6
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from ssl_lightning.backbones import ViT
from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward


def step(model: torch.nn.Module, x: torch.Tensor, keys: SampleKeys) -> tuple[torch.Tensor, ...]:
    """Output and parameter gradients of one keyed forward and backward."""
    model.zero_grad(set_to_none=True)
    with keyed_forward(keys):
        out = model(x)
    out.square().mean().backward()
    return (out.detach(), *(p.grad.detach() for p in model.parameters() if p.grad is not None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eager = ViT(image_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3,
                drop_path_rate=0.3).train()
    compiled = torch.compile(copy.deepcopy(eager))
    x = torch.randn(args.batch, 3, 32, 32)
    seeds = torch.arange(args.batch, dtype=torch.int64)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    worst = 0.0
    for s in range(args.steps):
        keys = SampleKeys.from_seeds(seeds + 1000 * s, 7, 0, 1, s)
        results = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            start = time.perf_counter()
            results[name] = step(model, x, keys)
            times[name].append(time.perf_counter() - start)
        worst = max(worst, max((a - b).abs().max().item()
                               for a, b in zip(*results.values(), strict=True)))
    eager_s = statistics.median(times["eager"][1:])
    compiled_s = statistics.median(times["compiled"][1:])
    print(f"ViT 4x96 on {args.batch} x 32 px, drop_path_rate 0.3, {args.steps} steps with new "
          f"keys each, {args.threads} thread(s)")
    print(f"largest |eager - compiled| over outputs and gradients: {worst:.2e}")
    print(f"first compiled step (compilation): {times['compiled'][0]:.1f} s")
    print(f"step time: eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms "
          f"({eager_s / compiled_s:.2f}x)")


if __name__ == "__main__":
    main()
