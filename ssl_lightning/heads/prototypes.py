"""Prototype heads: the DINO head and SwAV's prototype layer.

- DINO head: Caron et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV
  2021, §3.1 and Appendix: a 3-layer MLP (hidden 2048, GELU), a bottleneck of 256, L2
  normalisation and a weight-normalised last layer of K outputs whose magnitude is fixed to 1
  (``norm_last_layer``).
- SwAV prototypes: Caron et al., "Unsupervised Learning of Visual Features by Contrasting Cluster
  Assignments", NeurIPS 2020, §3.1: a bias-free linear layer whose rows (the prototypes) are
  L2-normalised before every training step.
- CrIBo's object head: a DINO head with a second last layer for object representations.
- L2-normalised linear layers: Darcet et al., "Cluster and Predict Latent Patches for Improved
  Masked Image Modeling", arXiv 2502.08769, 2025: CAPI's student head (a weight-normalised
  layer without bias, the magnitude of each row trainable from 1) and its clustering layer (a
  plain layer with a bias, weights drawn from N(0, 1)), both on L2-normalised inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.heads.mlp import build_mlp


class DINOHead(nn.Module):
    """MLP → bottleneck → L2 normalise → weight-normalised linear layer to K prototypes.

    The last layer is ``weight = g · v / ||v||`` per output row. With ``norm_last_layer=True``
    ``g`` is fixed to 1 (a frozen parameter), which DINO found stabilises training; the DINO
    method freezes ``last_layer_v``/``last_layer_g`` during the first epoch(s).

    Args:
        in_dim: Backbone feature size.
        out_dim: Number of prototypes K (65536 on ImageNet; a few thousand for CIFAR).
        hidden_dim: Width of the hidden layers (2048).
        bottleneck_dim: Output of the MLP before normalisation (256).
        num_layers: Linear layers in the MLP (3).
        batch_norm: BatchNorm in the MLP's hidden layers (off for ViTs in DINO).
        norm_last_layer: Fix the magnitude of each last-layer row to 1.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        num_layers: int = 3,
        batch_norm: bool = False,
        norm_last_layer: bool = True,
    ) -> None:
        super().__init__()
        if out_dim < 1 or bottleneck_dim < 1:
            raise ValueError(
                f"DINOHead needs out_dim >= 1 and bottleneck_dim >= 1, got {out_dim} and "
                f"{bottleneck_dim}."
            )
        self.mlp = build_mlp(in_dim, hidden_dim, bottleneck_dim, num_layers, batch_norm,
                             activation=nn.GELU)
        for module in self.mlp.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.last_layer_v = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        nn.init.trunc_normal_(self.last_layer_v, std=0.02)
        self.last_layer_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=not norm_last_layer)

    def last_layer_parameters(self) -> list[nn.Parameter]:
        """The parameters DINO freezes during the first epoch(s)."""
        return [self.last_layer_v, self.last_layer_g]

    def forward(self, x: Tensor) -> Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        weight = self.last_layer_g * F.normalize(self.last_layer_v, dim=1)
        return F.linear(x, weight)



class ObjectDINOHead(DINOHead):
    """A :class:`DINOHead` with a second weight-normalised last layer for object
    representations on the same MLP (CrIBo's head, the authors' ``DINOHead.forward_c``):
    ``forward`` scores the [CLS] features, :meth:`forward_objects` the objects.

    Args:
        in_dim, out_dim, hidden_dim, bottleneck_dim, num_layers, batch_norm, norm_last_layer:
            As :class:`DINOHead`.
        object_out_dim: Outputs of the object layer (CrIBo: 65536, ``out_dim_c``).
    """

    def __init__(self, in_dim: int, out_dim: int = 65536, hidden_dim: int = 2048,
                 bottleneck_dim: int = 256, num_layers: int = 3, batch_norm: bool = False,
                 norm_last_layer: bool = True, object_out_dim: int = 65536) -> None:
        super().__init__(in_dim, out_dim, hidden_dim, bottleneck_dim, num_layers, batch_norm,
                         norm_last_layer)
        if object_out_dim < 1:
            raise ValueError(f"object_out_dim must be >= 1, got {object_out_dim}.")
        self.object_layer_v = nn.Parameter(torch.empty(object_out_dim, bottleneck_dim))
        nn.init.trunc_normal_(self.object_layer_v, std=0.02)
        self.object_layer_g = nn.Parameter(torch.ones(object_out_dim, 1),
                                           requires_grad=not norm_last_layer)

    def last_layer_parameters(self) -> list[nn.Parameter]:
        """Both last layers (frozen together during the first epoch(s))."""
        return [*super().last_layer_parameters(), self.object_layer_v, self.object_layer_g]

    def forward_objects(self, x: Tensor) -> Tensor:
        """Object scores (..., object_out_dim) of object representations (..., in_dim)."""
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, self.object_layer_g * F.normalize(self.object_layer_v, dim=1))

class SwAVPrototypes(nn.Module):
    """K prototype vectors c_k scored against L2-normalised embeddings z: ``z @ C^T``.

    Call :meth:`normalize_` before each training forward (SwAV normalises the prototypes in place,
    outside autograd, at the start of every iteration).

    Args:
        dim: Embedding size (128).
        num_prototypes: K (3000 on ImageNet; a few hundred for CIFAR).
    """

    def __init__(self, dim: int = 128, num_prototypes: int = 3000) -> None:
        super().__init__()
        if num_prototypes < 1:
            raise ValueError(f"num_prototypes must be >= 1, got {num_prototypes}.")
        self.layer = nn.Linear(dim, num_prototypes, bias=False)

    @property
    def weight(self) -> Tensor:
        return self.layer.weight

    @torch.no_grad()
    def normalize_(self) -> None:
        """L2-normalise every prototype in place."""
        self.layer.weight.copy_(F.normalize(self.layer.weight, dim=1))

    def forward(self, z: Tensor) -> Tensor:
        return self.layer(z)

    def forward_weight(self) -> Tensor:
        """A copy of the prototypes (K, D) in the graph, for a loss that takes the matrix (MSN).
        A forward method, so a sharded (FSDP2) module gathers its weight first."""
        return self.layer.weight.clone()


class L2NormLinear(nn.Module):
    """``W x̂ + b`` on the L2-normalised input ``x̂``: CAPI's student head and clustering layer.

    Args:
        in_dim: Input size.
        out_dim: Outputs (CAPI: 16384 clusters).
        bias: A bias ``b`` (the clustering layer; the student head has none).
        weight_norm: ``W = g · v / ||v||`` per row with a trainable ``g`` starting at 1 and
            ``v`` from a truncated normal of std 0.02 (the student head); else ``W`` from
            N(0, ``init_std``²) (the clustering layer, std 1).
        init_std: Std of the plain weights.
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = False, weight_norm: bool = True,
                 init_std: float = 1.0) -> None:
        super().__init__()
        if min(in_dim, out_dim) < 1:
            raise ValueError(f"L2NormLinear needs in_dim, out_dim >= 1, got {in_dim}, {out_dim}.")
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1)) if weight_norm else None
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        if weight_norm:
            nn.init.trunc_normal_(self.weight, std=0.02)
        else:
            nn.init.normal_(self.weight, std=init_std)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight if self.weight_g is None else \
            self.weight_g * F.normalize(self.weight, dim=1)
        return F.linear(F.normalize(x, dim=-1), weight, self.bias)
