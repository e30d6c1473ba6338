"""DCL: Yeh et al., "Decoupled Contrastive Learning", ECCV 2022. SimCLR with the decoupled
contrastive loss (the positive pair out of the denominator), or its von Mises-Fisher weighted
form DCLW; everything else (views, projection MLP, gathering) is SimCLR's."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import DCLLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.methods.simclr import SimCLR


@register_method(
    "dcl", title="DCL", configs=("dcl.yaml",),
    paper=Paper("Decoupled Contrastive Learning", 2022, "2110.06848"),
    family="contrastive", views=TWO_VIEWS, docs="docs/contrastive_methods.md",
    tests="tests/methods/test_dcl.py",
    small=lambda backbone, **kw: DCL(backbone, projection_hidden_dim=16, projection_dim=8,
                                     head_batch_norm=False, **kw),
)
class DCL(SSLMethod):
    """DCL / DCLW: :class:`SimCLR`'s network and step with :class:`DCLLoss` in place of NT-Xent.

    A method of its own (rather than a ``loss`` argument of SimCLR) so that a config names
    what it trains and its defaults are DCL's. It shares SimCLR's projection head and step
    (``forward_views`` and ``loss_from_outputs`` are SimCLR's functions) but not its
    constructor, so it takes, and ``--model.help DCL`` offers, none of NT-Xent's options
    (``margin``, ``queue_size``).

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        temperature: DCL temperature (0.1, lightly's default; the paper sweeps 0.07-0.5).
        weight_sigma: σ of the DCLW positive weight (0.5 in the paper); ``None`` for DCL.
        loss_chunk_size: Anchor rows per block of the chunked loss; ``None`` for dense logits.
        projection_hidden_dim: Hidden width of the projection MLP.
        projection_dim: Output size of the projection MLP.
        projection_layers: Linear layers in the projection MLP.
        head_batch_norm: BatchNorm inside the projection MLP.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``).
        projection_batch_norm: Deprecated name of ``head_batch_norm``.
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    min_global_batch = SimCLR.min_global_batch
    min_global_batch_reason = (
        "DCL's negatives are the other samples of the global batch; with one sample there are "
        "none"
    )
    renamed_arguments = {"projection_batch_norm": "head_batch_norm"}

    #: NT-Xent options that checkpoints of DCL as a SimCLR subclass recorded at 0 (the only
    #: value DCL took); dropped at 0 so those checkpoints load, refused otherwise.
    nt_xent_only: ClassVar[tuple[str, ...]] = ("margin", "queue_size", "memory_bank_size")

    def __init__(
        self,
        backbone: nn.Module,
        temperature: float = 0.1,
        weight_sigma: float | None = None,
        loss_chunk_size: int | None = 1024,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        projection_layers: int = 2,
        head_batch_norm: bool = True,
        projector: nn.Module | None = None,
        *,
        projection_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        for name in self.nt_xent_only:
            value = kwargs.pop(name, None)
            if value:
                raise ValueError(f"DCL has no {name} (an NT-Xent option of SimCLR), got "
                                 f"{name}={value}; remove it or use SimCLR.")
        head_batch_norm = renamed_argument(self, "projection_batch_norm", projection_batch_norm,
                                           head_batch_norm)
        super().__init__(backbone, **kwargs)
        self.temperature, self.loss_chunk_size = temperature, loss_chunk_size
        self.weight_sigma = weight_sigma
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, projection_layers,
            batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")

    def build_criterion(self) -> nn.Module:
        return DCLLoss(self.temperature, self.weight_sigma, self.loss_chunk_size)

    forward_views = SimCLR.forward_views
    loss_from_outputs = SimCLR.loss_from_outputs
