"""Mixup over the global batch, the same on any number of processes.

Zhang et al., "mixup: Beyond Empirical Risk Minimization", ICLR 2018, applied to images only
(distillation has no labels to mix): ``λ x + (1 − λ) x[π]`` with one λ ~ U(0, 1) and one
permutation π of the global batch per step, both drawn from a seed every rank shares. The
distributed sampler gives rank r samples r, r + world, ... of the global batch, so rank r's
sample j is global sample ``j × world + r``; a gathered (rank-major) batch holds it in row
``r × B + j``. Drawing π over global positions makes N processes mix the pairs one process mixes.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def global_batch_mixup(x: Tensor, gathered: Tensor, world: int, rank: int, seed: int) -> Tensor:
    """This rank's images ``x`` (B, ...) mixed with their partners in the global batch.

    Args:
        x: This rank's images.
        gathered: Every rank's images, rank-major (world × B, ...); ``x`` itself on one process.
        world: Number of processes.
        rank: This process's rank.
        seed: The step's seed, the same on every rank.
    """
    if len(gathered) != world * len(x):
        raise ValueError(f"gathered holds {len(gathered)} images, not world ({world}) x "
                         f"batch ({len(x)}).")
    generator = torch.Generator().manual_seed(seed)
    lam = float(torch.rand((), generator=generator, dtype=torch.float64))
    perm = torch.randperm(len(gathered), generator=generator).to(x.device)
    partner = perm[torch.arange(len(x), device=x.device) * world + rank]  # global positions
    rows = (partner % world) * len(x) + partner // world  # -> rows of the gathered batch
    return lam * x + (1 - lam) * gathered[rows]
