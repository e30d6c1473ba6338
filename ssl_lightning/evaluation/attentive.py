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

import warnings
from typing import Any, Literal, cast

from torch import nn

from ssl_lightning.callbacks.probe_grid import AttentiveHeads, Source
from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX
from ssl_lightning.evaluation.linear import LinearEval
from ssl_lightning.heads.attentive_pooling import AttentivePooling

__all__ = ["AttentiveEval", "AttentiveHeads", "AttentivePooling"]


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
