"""The contrastive losses on the shared kernel, forward + backward on CPU, against their
reference side by side: lightly's counterpart where it has one, else the loss as written in
plain PyTorch (dense logits and ``F.cross_entropy``).

- ``nt_xent``, ``dcl``: two views of B × D; lightly's ``NTXentLoss``, ``DCLLoss``;
- ``nnclr``: both directions of (detached neighbours, predictions), B × D each; lightly's NNCLR
  loss is its ``NTXentLoss`` on the same pairs (which also contrasts the neighbours among
  themselves: more work, the loss lightly's NNCLR trains with);
- ``moco_v3``: both directions of (queries, detached keys); reference: plain PyTorch;
- ``supcon``: two views of B × D with labels of 100 classes; reference: plain PyTorch (Khosla
  et al., Eq. 2, with a (2B × 2B) positive mask);
- ``infonce``: B queries against their keys and 2B negatives; lightly's ``NTXentLoss`` with a
  memory bank of 2B (the MoCo v2 loss).

Every variant runs in a fresh subprocess (so allocator caches and earlier peaks do not leak
between them) on the same fp32 inputs (default B × D = 4096 × 128, unit-free random embeddings).
Reported per variant:

- median wall time and median process CPU time (user + system, all threads; the better
  figure on a shared machine) of one step (``loss = f(...); loss.backward()``) over
  ``--repeats`` runs after one warm-up;
- peak memory: the process's peak resident set size (``VmHWM``) during those runs minus the
  resident size just before them (inputs allocated, warm-up done, peak counter reset through
  ``/proc/self/clear_refs``), i.e. the extra memory the loss needs at its peak.

Requires ``pip install lightly`` (the ``benchmark`` extra) for the reference. Run::

    python benchmarks/loss_speed.py --threads 1
    python benchmarks/loss_speed.py --threads 1 --loss dcl --rounds 3

``ours_dense`` is our loss with ``chunk_size=None`` (the full logit matrix). ``matmul_bound``
(two-view losses) runs only the three matrix products of the chunked kernel (the logits and the
two gradients, which it takes in the forward pass while each block is in cache): the floor for
an exact fp32 loss.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

VARIANTS = ("ours", "ours_dense", "lightly", "plain_torch", "matmul_bound")


def _memory_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0])
    return fields


def _matmul_bound(z1, z2):  # type: ignore[no-untyped-def]
    """Only the three products of the chunked kernel (logits, both gradients) in blocks of the
    kernel's rows: a lower bound for any exact fp32 NT-Xent."""
    import torch

    from ssl_lightning.losses.chunked_contrastive import block_rows

    a = torch.cat([z1, z2]).detach()
    rows = block_rows(1024, len(a), len(a), a.element_size())
    block, grad_a, grad_c = a.new_empty(rows, len(a)), torch.empty_like(a), torch.zeros_like(a)
    for start in range(0, len(a), rows):
        torch.mm(a[start:start + rows], a.T, out=block)
        torch.mm(block, a, out=grad_a[start:start + rows])
        grad_c.addmm_(block.T, a[start:start + rows])
    return (grad_a.sum() + grad_c.sum()).requires_grad_()


def _supcon_plain(z1, z2, labels, temperature: float):  # type: ignore[no-untyped-def]
    """SupCon (Khosla et al., Eq. 2, L_out) as written in plain PyTorch: dense logits and an
    (2B × 2B) positive mask."""
    import torch
    import torch.nn.functional as F

    features = F.normalize(torch.cat([z1, z2]), dim=1)
    classes = labels.repeat(2)
    logits = features @ features.T / temperature
    own = torch.eye(len(features), dtype=torch.bool)
    log_prob = logits - logits.masked_fill(own, float("-inf")).logsumexp(dim=1, keepdim=True)
    positive = (classes[:, None] == classes[None, :]) & ~own
    return -((log_prob * positive).sum(dim=1) / positive.sum(dim=1)).mean()


def _moco_v3_plain(query, keys, temperature: float):  # type: ignore[no-untyped-def]
    """One MoCo v3 direction as in the paper's pseudocode: ``2T · CE(q kᵀ / T, arange)``."""
    import torch
    import torch.nn.functional as F

    q, k = F.normalize(query, dim=1), F.normalize(keys.detach(), dim=1)
    labels = torch.arange(len(q))
    return F.cross_entropy(q @ k.T / temperature, labels) * (2 * temperature)


class Case(NamedTuple):
    """One loss of the shared kernel: our class, its reference (lightly's class, or ``None``
    for the loss written in plain PyTorch), and how one training step calls it."""

    ours: str
    lightly: str | None
    call: str  # "two_views", "two_directions", "labels" or "bank"


CASES = {
    "nt_xent": Case("NTXentLoss", "NTXentLoss", "two_views"),
    "dcl": Case("DCLLoss", "DCLLoss", "two_views"),
    # lightly's NNCLR loss is its NTXentLoss on (neighbours, predictions), both directions
    "nnclr": Case("NNCLRLoss", "NTXentLoss", "two_directions"),
    "moco_v3": Case("MoCoV3Loss", None, "two_directions"),
    "supcon": Case("SupConLoss", None, "labels"),
    # lightly's InfoNCE (MoCo v2) is its NTXentLoss with a memory bank of negatives
    "infonce": Case("InfoNCELoss", "NTXentLoss", "bank"),
}
LOSSES = tuple(CASES)
SUPCON_CLASSES = 100


def variants_of(loss: str) -> tuple[str, ...]:
    """The variants measured for ``loss``: ours (chunked), our dense path, the reference
    (``lightly`` or ``plain_torch``) and, for the two-view losses, the bound."""
    return (("ours", "ours_dense", reference_of(loss))
            + (("matmul_bound",) if CASES[loss].call == "two_views" else ()))


def reference_of(loss: str) -> str:
    """The variant the others are compared with."""
    return "lightly" if CASES[loss].lightly else "plain_torch"


def _inputs(loss: str, batch: int, dim: int):  # type: ignore[no-untyped-def]
    """The tensors of one step (fixed seed) and those of them that receive gradients."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def randn(rows: int, grad: bool):  # type: ignore[no-untyped-def]
        return torch.randn(rows, dim, generator=generator).requires_grad_(grad)

    call = CASES[loss].call
    if call == "two_views":
        z = (randn(batch, True), randn(batch, True))
        return z, list(z)
    if call == "labels":
        z = (randn(batch, True), randn(batch, True))
        labels = torch.randint(0, SUPCON_CLASSES, (batch,), generator=generator)
        return (*z, labels), list(z)
    if call == "two_directions":  # (detached neighbours or keys, predictions or queries) x 2
        a1, a2, p1, p2 = randn(batch, False), randn(batch, False), randn(batch, True), randn(
            batch, True)
        return (a1, a2, p1, p2), [p1, p2]
    query, key, negatives = randn(batch, True), randn(batch, False), randn(2 * batch, False)
    return (query, key, negatives), [query]


def _make_step(variant: str, loss: str, temperature: float, batch: int, dim: int):  # type: ignore[no-untyped-def]
    """``step(*inputs) -> loss`` of one training step of ``loss`` in ``variant``."""
    case = CASES[loss]
    if variant == "matmul_bound":
        return _matmul_bound
    if variant == "plain_torch":
        if loss == "supcon":
            return lambda z1, z2, labels: _supcon_plain(z1, z2, labels, temperature)
        fn = functools.partial(_moco_v3_plain, temperature=temperature)
    elif variant == "lightly":
        import lightly.loss

        cls = getattr(lightly.loss, case.lightly)
        if case.call == "bank":  # a full bank of 2 x batch negatives from the first call
            bank = cls(temperature=temperature, memory_bank_size=(2 * batch, dim))
            return lambda query, key, negatives: bank(query, key)
        fn = cls(temperature=temperature)
    elif variant in ("ours", "ours_dense"):
        from ssl_lightning import losses

        cls = getattr(losses, case.ours)
        fn = cls(temperature, chunk_size=None) if variant == "ours_dense" else cls(temperature)
    else:
        raise ValueError(f"Unknown variant {variant!r}; choose from {VARIANTS}.")
    if loss == "moco_v3":  # (queries, keys of the other view), both ways
        return lambda k1, k2, q1, q2: (fn(q1, k2) + fn(q2, k1)) / 2
    if loss == "nnclr":  # (neighbours, predictions of the other view), both ways
        return lambda n1, n2, p1, p2: (fn(n1, p2) + fn(n2, p1)) / 2
    return fn


def run_variant(args: argparse.Namespace) -> dict[str, float]:
    """Measure one variant in this process (called in the child)."""
    import torch

    torch.set_num_threads(args.threads)
    inputs, leaves = _inputs(args.loss, args.batch, args.dim)
    loss_fn = _make_step(args.variant, args.loss, args.temperature, args.batch, args.dim)

    def step() -> float:
        for leaf in leaves:
            leaf.grad = None
        loss = loss_fn(*inputs)
        loss.backward()
        return float(loss)

    value = step()  # warm-up
    for leaf in leaves:
        leaf.grad = None
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
            repeats: int = 5, threads: int = 1, variants: tuple[str, ...] | None = None,
            rounds: int = 1, in_process: bool = False) -> dict[str, dict[str, float]]:
    """Per variant (default: :func:`variants_of`), the medians over ``rounds`` of its child
    process' figures; the variants' children alternate within each round, so load changes hit
    them alike. ``in_process``: every variant in this process instead (no process start; its
    peak-memory figure then includes what earlier variants left allocated: a check that the
    variants run, not figures)."""
    variants = variants or variants_of(loss)
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:
            if in_process:
                import torch

                threads_before = torch.get_num_threads()
                runs[variant].append(run_variant(argparse.Namespace(
                    variant=variant, loss=loss, batch=batch, dim=dim, temperature=temperature,
                    repeats=repeats, threads=threads)))
                torch.set_num_threads(threads_before)
                continue
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
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        help="default: all of the loss's (ours, ours_dense, its reference, ...)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    results = measure(args.loss, args.batch, args.dim, args.temperature, args.repeats,
                      args.threads, tuple(args.variants or ()), args.rounds)
    reference = results.get(reference_of(args.loss))
    print(f"{args.loss} fwd+bwd, B x D = {args.batch} x {args.dim} fp32, CPU, {args.threads} "
          f"thread(s), median of {args.repeats} x {args.rounds} round(s); ratios to "
          f"{reference_of(args.loss)}")
    print(f"{'variant':<13}{'wall s':>8}{'cpu s':>8}{'peak MiB':>10}{'cpu ratio':>13}"
          f"{'wall ratio':>14}{'mem ratio':>13}{'loss':>9}")
    for variant, r in results.items():
        ratios = [r[k] / reference[k] if reference else float("nan")
                  for k in ("median_cpu_s", "median_s", "peak_extra_mib")]
        loss = f"{r['loss']:>9.4f}" if variant != "matmul_bound" else f"{'':>9}"
        print(f"{variant:<13}{r['median_s']:>8.2f}{r['median_cpu_s']:>8.2f}"
              f"{r['peak_extra_mib']:>10.0f}{ratios[0]:>13.2f}{ratios[1]:>14.2f}"
              f"{ratios[2]:>13.2f}{loss}")


if __name__ == "__main__":
    main()
