"""DCL: Yeh et al., "Decoupled Contrastive Learning", ECCV 2022. SimCLR with the decoupled
contrastive loss (the positive pair out of the denominator), or its von Mises-Fisher weighted
form DCLW; everything else (views, projection MLP, gathering) is SimCLR's."""

from __future__ import annotations

from typing import Any

from torch import nn

from ssl_lightning.losses import DCLLoss
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.methods.simclr import SimCLR


@register_method(
    "dcl", title="DCL", configs=("dcl.yaml",),
    paper=Paper("Decoupled Contrastive Learning", 2022, "2110.06848"),
    family="contrastive", views=TWO_VIEWS, docs="docs/contrastive_methods.md",
    tests="tests/methods/test_renamed_arguments.py",
    opt_outs={"model_help_accepted": (
        "--model.help DCL offers SimCLR's NT-Xent options margin, queue_size and "
        "memory_bank_size (inherited through **kwargs) and DCL refuses them, since old "
        "checkpoints pass them back at their fixed values; until DCL stops inheriting "
        "SimCLR's __init__, passing another value is one clear error")},
    small=lambda backbone, **kw: DCL(backbone, projection_hidden_dim=16, projection_dim=8,
                                     head_batch_norm=False, **kw),
)
class DCL(SimCLR):
    """DCL / DCLW: :class:`SimCLR` with :class:`DCLLoss` in place of NT-Xent.

    A method of its own (rather than a ``loss`` argument of SimCLR) so that a config names
    what it trains and its defaults are DCL's, while it shares all of SimCLR's code.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        temperature: DCL temperature (0.1, lightly's default; the paper sweeps 0.07-0.5).
        weight_sigma: σ of the DCLW positive weight (0.5 in the paper); ``None`` for DCL.
        loss_chunk_size: Anchor rows per block of the chunked loss; ``None`` for dense logits.
        **kwargs: Projection-head arguments of :class:`SimCLR` and optimiser arguments of
            :class:`SSLMethod`.
    """

    def __init__(
        self,
        backbone: nn.Module,
        temperature: float = 0.1,
        weight_sigma: float | None = None,
        loss_chunk_size: int | None = 1024,
        **kwargs: Any,
    ) -> None:
        for name in ("margin", "queue_size", "memory_bank_size"):
            if kwargs.get(name):
                raise ValueError(f"DCL has no {name} (an NT-Xent option of SimCLR), got "
                                 f"{name}={kwargs[name]}; remove it or use SimCLR.")
        super().__init__(backbone, temperature=temperature, loss_chunk_size=loss_chunk_size,
                         **kwargs)

    def build_criterion(self) -> nn.Module:
        hp = self.hparams
        return DCLLoss(hp["temperature"], hp["weight_sigma"], hp["loss_chunk_size"])
