"""Attentive probing: a cross-attention pooling head over frozen patch tokens + a linear
classifier, trained with the grid of :class:`~ssl_lightning.evaluation.LinearEval`.

The headline protocol of the masked-image methods: AIM (El-Nouby et al., ICML 2024, §4.1:
an attentive probe, one learned query), V-JEPA (Bardes et al., 2024, §4: a cross-attention
block with one learned query over the frozen tokens) and CAPI (Darcet et al., 2025: attentive
probes with a learning rate × weight decay grid). Learned queries attend, with multi-head
attention, over the LayerNorm-ed patch tokens of the last block(s). With ``mlp_ratio`` (the
default of :class:`AttentiveEval`, 4) the attention is V-JEPA's whole cross-attention block
(the attentive pooler of its released code with the complete block): the attention output is
added to the queries, then a pre-norm MLP block (LayerNorm, Linear to ``mlp_ratio·D``,
GELU, Linear back) is added with a residual, and its linears start as V-JEPA's (normal, std
0.02; the two output projections divided by sqrt 2). Without it (``mlp_ratio=None``) the
head is AIM's: the attention output alone. The query outputs are averaged and classified by a
linear layer. The head has no position information, so it is invariant to the order of the
tokens.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ssl_lightning.callbacks.probe_grid import HeadSpec, Source
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX
from ssl_lightning.evaluation.linear import LinearEval


class AttentivePooling(nn.Module):
    """Learned queries cross-attending over tokens: (B, N, D) -> (B, D).

    ``LayerNorm(tokens)`` gives keys and values (``k_proj``, ``v_proj``); the queries
    (``num_queries`` × D, ``q_proj``) attend with ``num_heads`` heads of ``D / num_heads``
    channels, scaled by ``1 / sqrt(D / num_heads)``; the heads' outputs are joined and
    projected (``out_proj``). With ``mlp_ratio`` (V-JEPA's block) the result is
    ``a = queries + out_proj(...)`` then ``a + mlp(mlp_norm(a))``; the query outputs are
    averaged.
    """

    def __init__(self, dim: int, num_heads: int = 1, num_queries: int = 1,
                 mlp_ratio: float | None = None) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"The attentive probe's num_heads ({num_heads}) must divide the "
                             f"token width {dim}.")
        if num_queries < 1:
            raise ValueError(f"num_queries must be >= 1, got {num_queries}.")
        if mlp_ratio is not None and not (mlp_ratio > 0 and int(dim * mlp_ratio) >= 1):
            raise ValueError(f"The attentive probe's mlp_ratio must be > 0 (or null: no MLP "
                             f"block), got {mlp_ratio}.")
        self.num_heads = num_heads
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim)
                                                                for _ in range(4))
        self.mlp_norm: nn.LayerNorm | None = None
        self.mlp: nn.Sequential | None = None
        if mlp_ratio is not None:
            hidden = int(dim * mlp_ratio)
            self.mlp_norm = nn.LayerNorm(dim)
            fc1, fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
            self.mlp = nn.Sequential(fc1, nn.GELU(), fc2)
            for linear in (self.q_proj, self.k_proj, self.v_proj, self.out_proj, fc1, fc2):
                nn.init.normal_(linear.weight, std=0.02)
                nn.init.zeros_(linear.bias)
            with torch.no_grad():  # the residual branches' outputs, as V-JEPA's first block
                self.out_proj.weight.div_(math.sqrt(2.0))
                fc2.weight.div_(math.sqrt(2.0))

    def forward(self, tokens: Tensor) -> Tensor:
        b, n, d = tokens.shape
        h, dh = self.num_heads, d // self.num_heads
        x = self.norm(tokens)
        q = self.q_proj(self.queries).view(-1, h, dh).transpose(0, 1)  # (h, Q, dh)
        k = self.k_proj(x).view(b, n, h, dh).transpose(1, 2)  # (B, h, N, dh)
        v = self.v_proj(x).view(b, n, h, dh).transpose(1, 2)
        attention = (q @ k.transpose(-1, -2) / math.sqrt(dh)).softmax(dim=-1)  # (B, h, Q, N)
        out = self.out_proj((attention @ v).transpose(1, 2).reshape(b, -1, d))  # (B, Q, D)
        if self.mlp is not None and self.mlp_norm is not None:
            out = self.queries + out
            out = out + self.mlp(self.mlp_norm(out))
        return out.mean(dim=1)


class AttentiveHeads(nn.Module):
    """One :class:`AttentivePooling` + ``nn.Linear`` per head of the grid; ``forward`` takes
    :func:`~ssl_lightning.callbacks.probe_grid.source_features`' dict (``tokens`` sources) and
    returns logits (heads, B, classes)."""

    def __init__(self, specs: Sequence[HeadSpec], dims: dict[Source, int], num_classes: int,
                 num_heads: int, num_queries: int, mlp_ratio: float | None = None) -> None:
        super().__init__()
        self.specs = list(specs)
        self.num_classes = num_classes
        self.heads = nn.ModuleList(
            nn.Sequential(AttentivePooling(dims[s.source], num_heads, num_queries, mlp_ratio),
                          nn.Linear(dims[s.source], num_classes)) for s in self.specs)
        self.sources = list(dict.fromkeys(s.source for s in self.specs))

    def forward(self, features: dict[Source, Tensor]) -> Tensor:
        return torch.stack([head(features[spec.source])
                            for spec, head in zip(self.specs, self.heads, strict=True)])


class AttentiveEval(LinearEval):
    """An attentive probe grid on a frozen token backbone (ours or a timm ViT).

    Like :class:`LinearEval` (one frozen forward per batch, every head with its own learning
    rate and weight decay, the best head on val top-1 is ``val/top1``), with the heads of
    :class:`AttentiveHeads` reading the patch tokens of the last ``last_blocks`` blocks.
    AdamW by default, as V-JEPA and CAPI train their attentive probes.

    Args:
        backbone, num_classes, checkpoint, checkpoint_prefix, lr, lr_scaling, momentum,
            weight_decay, warmup_epochs, image_size, lrs, weight_decays, last_blocks,
            optimizer: As :class:`LinearEval` (no fine-tuning, no poolings).
        num_heads: Attention heads of the pooling.
        num_queries: Learned queries (averaged after attending).
        mlp_ratio: V-JEPA's cross-attention block: the residual on the queries and an MLP block
            of ``mlp_ratio × D`` hidden units (4, V-JEPA's); None: the attention alone (AIM's
            probe, the head before this option existed).
    """

    head_kind = "tokens"

    def __init__(
        self,
        backbone: nn.Module | None = None,
        num_classes: int | None = None,
        checkpoint: str | None = None,
        checkpoint_prefix: str = DEFAULT_PREFIX,
        lr: float = 1e-3,
        lr_scaling: Literal["none", "linear"] = "linear",
        momentum: float = 0.9,
        weight_decay: float = 0.05,
        warmup_epochs: float = 0.0,
        image_size: int = 32,
        lrs: list[float] | None = None,
        weight_decays: list[float] | None = None,
        last_blocks: list[int] | None = None,
        optimizer: Literal["sgd", "adamw"] = "adamw",
        num_heads: int = 1,
        num_queries: int = 1,
        mlp_ratio: float | None = 4.0,
    ) -> None:
        self._attentive = (num_heads, num_queries, mlp_ratio)
        super().__init__(backbone, num_classes, checkpoint, checkpoint_prefix, finetune=False,
                         lr=lr, lr_scaling=lr_scaling, momentum=momentum,
                         weight_decay=weight_decay, warmup_epochs=warmup_epochs,
                         image_size=image_size, lrs=lrs, weight_decays=weight_decays,
                         last_blocks=last_blocks, poolings=["tokens"], optimizer=optimizer)

    def build_heads(self, dims: dict[Source, int], num_classes: int) -> nn.Module:
        return AttentiveHeads(self.specs, dims, num_classes, *self._attentive)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read a checkpoint saved before ``mlp_ratio`` existed (its heads have no MLP block):
        the heads are rebuilt without it, with a ``FutureWarning``."""
        super().on_load_checkpoint(checkpoint)
        state = checkpoint["state_dict"]
        heads = [key for key in state if key.startswith("classifier.heads.")]
        saved_heads, saved_mlp = bool(heads), any(".mlp" in key for key in heads)
        if self._attentive[2] is None or saved_mlp or not saved_heads:
            return
        warnings.warn("This AttentiveEval checkpoint was saved before mlp_ratio existed: its "
                      "heads are the attention alone, loaded as mlp_ratio: null (set it so in "
                      "the config to silence this).", FutureWarning, stacklevel=2)
        self._attentive = (*self._attentive[:2], None)
        self.hparams["mlp_ratio"] = None
        old = cast(AttentiveHeads, self.classifier)
        dims = {spec.source: head[0].norm.normalized_shape[0]
                for spec, head in zip(self.specs, old.heads, strict=True)}
        self.classifier = self.build_heads(dims, old.num_classes).to(
            next(old.parameters()).device)
