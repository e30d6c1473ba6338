"""NT-Xent forward + backward on CPU: ours vs lightly's ``NTXentLoss``, side by side.

Every variant runs in a fresh subprocess (so allocator caches and earlier peaks do not leak
between them) on the same fp32 inputs (two views of B × D, default 4096 × 128, unit-free random
embeddings that require grad). Reported per variant:

- median wall time and median process CPU time (user + system, all threads; the better
  figure on a shared machine) of ``loss = f(z1, z2); loss.backward()`` over ``--repeats`` runs
  after one warm-up;
- peak memory: the process's peak resident set size (``VmHWM``) during those runs minus the
  resident size just before them (inputs allocated, warm-up done, peak counter reset through
  ``/proc/self/clear_refs``), i.e. the extra memory the loss needs at its peak.

Requires ``pip install lightly`` (the ``benchmark`` extra) for the reference. Run::

    python benchmarks/loss_speed.py --threads 1
    python benchmarks/loss_speed.py --threads 1 --loss dcl --rounds 3

``matmul_bound`` runs only the four matrix products of the chunked kernel (the logits, their
recomputation in the backward pass, the two gradients): the floor for an exact fp32 loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("ours", "ours_dense", "lightly", "matmul_bound")


def _memory_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0])
    return fields


def _matmul_bound(z1, z2):  # type: ignore[no-untyped-def]
    """Only the four products of the chunked kernel (logits, their recomputation, both
    gradients) in blocks of the kernel's rows: a lower bound for any exact fp32 NT-Xent."""
    import torch

    from ssl_lightning.losses.chunked_contrastive import block_rows

    a = torch.cat([z1, z2]).detach()
    rows = block_rows(1024, len(a), len(a), a.element_size())
    block, grad_a, grad_c = a.new_empty(rows, len(a)), torch.empty_like(a), torch.zeros_like(a)
    for start in range(0, len(a), rows):
        torch.mm(a[start:start + rows], a.T, out=block)
        torch.mm(a[start:start + rows], a.T, out=block)
        torch.mm(block, a, out=grad_a[start:start + rows])
        grad_c.addmm_(block.T, a[start:start + rows])
    return (grad_a.sum() + grad_c.sum()).requires_grad_()


# The losses on the shared kernel that lightly also has, by their (common) class name.
LIGHTLY_NAMES = {"nt_xent": "NTXentLoss", "dcl": "DCLLoss"}
LOSSES = tuple(LIGHTLY_NAMES)


def _make_loss(variant: str, loss: str, temperature: float):  # type: ignore[no-untyped-def]
    if variant == "matmul_bound":
        return _matmul_bound
    if variant == "lightly":
        import lightly.loss

        return getattr(lightly.loss, LIGHTLY_NAMES[loss])(temperature=temperature)
    from ssl_lightning import losses

    ours = getattr(losses, LIGHTLY_NAMES[loss])  # the same class names
    if variant == "ours":  # the default: row-chunked log-sum-exp (chunk_size=1024)
        return ours(temperature)
    if variant == "ours_dense":  # the full (2B x 2B) logit matrix
        return ours(temperature, chunk_size=None)
    raise ValueError(f"Unknown variant {variant!r}; choose from {VARIANTS}.")


def run_variant(args: argparse.Namespace) -> dict[str, float]:
    """Measure one variant in this process (called in the child)."""
    import torch

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    z1 = torch.randn(args.batch, args.dim, generator=generator).requires_grad_()
    z2 = torch.randn(args.batch, args.dim, generator=generator).requires_grad_()
    loss_fn = _make_loss(args.variant, args.loss, args.temperature)

    def step() -> float:
        z1.grad = z2.grad = None
        loss = loss_fn(z1, z2)
        loss.backward()
        return float(loss)

    value = step()  # warm-up
    z1.grad = z2.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter to the current RSS
    baseline = _memory_kib()["VmRSS"]
    times, cpu_times = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak = _memory_kib()["VmHWM"]
    return {"median_s": statistics.median(times), "median_cpu_s": statistics.median(cpu_times),
            "peak_extra_mib": (peak - baseline) / 1024, "loss": value}


def measure(loss: str = "nt_xent", batch: int = 4096, dim: int = 128, temperature: float = 0.5,
            repeats: int = 5, threads: int = 1, variants: tuple[str, ...] = VARIANTS,
            rounds: int = 1) -> dict[str, dict[str, float]]:
    """Per variant, the medians over ``rounds`` of its child process' figures; the variants'
    children alternate within each round, so load changes hit them alike."""
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            child = [sys.executable, __file__, "--variant", variant, "--loss", loss,
                     "--batch", str(batch), "--dim", str(dim), "--temperature",
                     str(temperature), "--repeats", str(repeats), "--threads", str(threads)]
            output = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(output.strip().splitlines()[-1]))
    return {variant: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for variant, results in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4096, help="samples per view")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of children")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--loss", default="nt_xent", choices=LOSSES)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    results = measure(args.loss, args.batch, args.dim, args.temperature, args.repeats,
                      args.threads, tuple(args.variants), args.rounds)
    reference = results.get("lightly")
    print(f"{args.loss} fwd+bwd, 2 x {args.batch} x {args.dim} fp32, CPU, {args.threads} "
          f"thread(s), median of {args.repeats} x {args.rounds} round(s)")
    print(f"{'variant':<13}{'wall s':>8}{'cpu s':>8}{'peak MiB':>10}{'cpu/lightly':>13}"
          f"{'wall/lightly':>14}{'mem/lightly':>13}{'loss':>9}")
    for variant, r in results.items():
        ratios = [r[k] / reference[k] if reference else float("nan")
                  for k in ("median_cpu_s", "median_s", "peak_extra_mib")]
        loss = f"{r['loss']:>9.4f}" if variant != "matmul_bound" else f"{'':>9}"
        print(f"{variant:<13}{r['median_s']:>8.2f}{r['median_cpu_s']:>8.2f}"
              f"{r['peak_extra_mib']:>10.0f}{ratios[0]:>13.2f}{ratios[1]:>14.2f}"
              f"{ratios[2]:>13.2f}{loss}")


if __name__ == "__main__":
    main()
