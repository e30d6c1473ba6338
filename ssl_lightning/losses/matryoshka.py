"""Matryoshka loss: one distillation loss per nested head level, summed.

Franca (Venkataramanan et al., arXiv 2507.14137, 2025, §3.1): the teacher and student head
outputs are ``[logits_1 | … | logits_L]`` (:class:`~ssl_lightning.heads.matryoshka.
MatryoshkaDINOHead`); level l is an independent clustering problem with its own softmax, its own
centre (or Sinkhorn-Knopp targets) and its own cross-entropy, and the loss is the sum over levels
``ℓ = Σ_l ℓ_l``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

Logits = Tensor | Sequence[Tensor]


def split_levels(logits: Logits, sizes: Sequence[int]) -> list[Any]:
    """Split the last dimension of a tensor (or of each tensor of a sequence) into the levels'
    sizes: one tensor (or list of tensors) per level."""
    if isinstance(logits, Tensor):
        return list(logits.split(list(sizes), dim=-1))
    per_tensor = [split_levels(t, sizes) for t in logits]
    return [[parts[level] for parts in per_tensor] for level in range(len(sizes))]


class MatryoshkaLoss(nn.Module):
    """``Σ_l losses[l](student_l, teacher_l, *rest)`` over the levels of concatenated logits.

    Args:
        losses: One loss per level (e.g. :class:`~ssl_lightning.losses.DINOLoss` or
            :class:`~ssl_lightning.losses.IBOTPatchLoss` sized ``sizes[l]``), each called as
            ``loss(student, teacher, *rest)``.
        sizes: Prototypes per level, in the order of the concatenation.
    """

    def __init__(self, losses: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        super().__init__()
        if len(losses) != len(sizes) or not sizes:
            raise ValueError(f"MatryoshkaLoss needs one loss per level, got {len(losses)} "
                             f"losses for {len(sizes)} sizes.")
        self.levels = nn.ModuleList(losses)
        self.sizes = list(sizes)

    def forward(self, student: Logits, teacher: Logits, *rest: Any) -> Tensor:
        """The sum of the levels' losses (``rest``: the levels' other arguments, shared)."""
        width = sum(self.sizes)
        for name, logits in (("student", student), ("teacher", teacher)):
            last = logits.shape[-1] if isinstance(logits, Tensor) else logits[0].shape[-1]
            if last != width:
                raise ValueError(f"MatryoshkaLoss expects {name} logits of width {width} "
                                 f"(levels {self.sizes}), got {last}.")
        students, teachers = split_levels(student, self.sizes), split_levels(teacher, self.sizes)
        losses = [loss(s, t, *rest)
                  for loss, s, t in zip(self.levels, students, teachers, strict=True)]
        return sum(losses[1:], losses[0])
