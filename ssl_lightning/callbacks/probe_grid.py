"""A grid of probe heads trained together on one frozen forward per batch.

DINOv2's ``eval/linear.py`` (Oquab et al., TMLR 2024, §7 and its code) trains 52 linear heads on
one pass of the frozen backbone: 13 learning rates (1e-5 ... 0.1) × {last block, last 4 blocks}
× {[CLS], [CLS] + mean patch token}, and reports the best. CAPI (Darcet et al., 2025) trains
10 learning rates × 3 weight decays. A head of the grid is a :class:`HeadSpec`: its learning
rate, its weight decay and its *feature source* (how many of the last blocks, which pooling).

Feature sources (:func:`source_features`, one forward for all of them):

- ``pooled``: the backbone's output ``backbone(x)`` (any backbone; a CNN's pooled feature);
- ``cls``: the final-norm [CLS] tokens of the last ``n`` blocks, concatenated;
- ``mean``: the mean patch tokens of the last ``n`` blocks, concatenated;
- ``cls+mean``: the ``n`` [CLS] tokens and the mean patch token of the last block (DINOv2's
  ``create_linear_input`` with ``use_avgpool``);
- ``tokens``: the patch tokens of the last ``n`` blocks concatenated along the channels,
  (B, patches, n·D), for attentive probes (:class:`AttentiveHeads`).

The token sources need a token backbone (ours :class:`~ssl_lightning.backbones.ViT`, or a
``TimmBackbone`` whose model has ``blocks``, ``norm`` and ``num_prefix_tokens``, as timm's
ViTs do). Every head has its own parameters and its own optimiser parameter groups
(:func:`head_param_groups`), so each trains exactly as if it were trained alone: the summed
loss gives each head the gradient of its own loss.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor, nn

from ssl_lightning.backbones import feature_dim
from ssl_lightning.heads.attentive_pooling import AttentivePooling

Pooling = Literal["pooled", "cls", "mean", "cls+mean", "tokens"]
POOLINGS: tuple[str, ...] = ("pooled", "cls", "mean", "cls+mean", "tokens")
#: A feature source: (number of last blocks, pooling).
Source = tuple[int, str]


@dataclass(frozen=True)
class HeadSpec:
    """One head of the grid: its learning rate (before scaling), weight decay and source."""

    lr: float
    weight_decay: float
    last_blocks: int
    pooling: str

    @property
    def source(self) -> Source:
        return (self.last_blocks, self.pooling)

    @property
    def name(self) -> str:
        """A short unique name, e.g. ``blocks4_cls+mean_lr0.001_wd0``."""
        return f"blocks{self.last_blocks}_{self.pooling}_lr{self.lr:g}_wd{self.weight_decay:g}"


def probe_grid(
    lrs: Sequence[float], weight_decays: Sequence[float], last_blocks: Sequence[int] = (1,),
    poolings: Sequence[str] = ("pooled",),
) -> list[HeadSpec]:
    """Every combination of the four lists, sources outermost (the order of the logs).

    ``pooled`` (the backbone's output) has no blocks to choose: its heads come once, as the
    source ``(1, "pooled")`` (named ``blocks1_pooled_...``), where ``last_blocks`` first holds
    a value; the other poolings take every ``last_blocks`` value.

    Raises:
        ValueError: an empty list, a value out of range, a duplicate, or ``last_blocks`` other
            than ``[1]`` with ``pooled`` as the only pooling (nothing would read the blocks).
    """
    for name, values in (("lrs", lrs), ("weight_decays", weight_decays),
                         ("last_blocks", last_blocks), ("poolings", poolings)):
        if len(values) == 0:
            raise ValueError(f"The probe grid's {name} is empty; give at least one value.")
        if len(set(values)) != len(values):
            raise ValueError(f"The probe grid's {name} has duplicates: {list(values)}.")
    if any(not lr > 0 for lr in lrs):
        raise ValueError(f"Every learning rate of the grid must be > 0, got {list(lrs)}.")
    if any(wd < 0 for wd in weight_decays):
        raise ValueError(f"Every weight decay of the grid must be >= 0, got {list(weight_decays)}.")
    if any(n < 1 for n in last_blocks):
        raise ValueError(f"Every last_blocks value must be >= 1, got {list(last_blocks)}.")
    unknown = [p for p in poolings if p not in POOLINGS]
    if unknown:
        raise ValueError(f"Unknown pooling {unknown}; choose from {list(POOLINGS)}.")
    if list(poolings) == ["pooled"] and list(last_blocks) != [1]:
        raise ValueError(
            f"last_blocks {list(last_blocks)} choose token blocks, but the only pooling is "
            "'pooled' (the backbone's output, which has no blocks to choose): use last_blocks "
            "[1], or add a token pooling (cls, mean, cls+mean).")
    sources = list(dict.fromkeys((1 if pooling == "pooled" else n, pooling)
                                 for n, pooling in itertools.product(last_blocks, poolings)))
    return [HeadSpec(lr, wd, n, pooling)
            for (n, pooling), lr, wd in itertools.product(sources, lrs, weight_decays)]


def token_model(backbone: nn.Module) -> nn.Module | None:
    """The module holding ``blocks``, ``norm`` and ``num_prefix_tokens`` (ours or timm's ViT)."""
    for module in (backbone, getattr(backbone, "net", None)):
        if (isinstance(getattr(module, "blocks", None), nn.Sequential | nn.ModuleList)
                and isinstance(getattr(module, "norm", None), nn.Module)
                and isinstance(getattr(module, "num_prefix_tokens", None), int)):
            return module
    return None


def check_sources(backbone: nn.Module, sources: Sequence[Source]) -> None:
    """Refuse, before training, token sources on a backbone without tokens or blocks."""
    model = token_model(backbone)
    for n, pooling in sources:
        if pooling == "pooled":
            continue
        if model is None:
            what = " (the attentive heads' patch tokens)" if pooling == "tokens" else ""
            raise ValueError(
                f"pooling {pooling!r}{what} needs a token backbone (a ViT: blocks, norm, "
                f"num_prefix_tokens); {type(backbone).__name__} has only its pooled output: "
                "use poolings [pooled].")
        if n > len(model.blocks):  # type: ignore[arg-type]
            raise ValueError(f"last_blocks {n} > the backbone's {len(model.blocks)} blocks.")  # type: ignore[arg-type]


@contextmanager
def _block_outputs(model: nn.Module, n: int) -> Iterator[list[Tensor]]:
    """Records the outputs of the last ``n`` blocks of ``model`` during the forwards inside."""
    outputs: list[Tensor] = []
    blocks = list(model.blocks)  # type: ignore[arg-type]
    hooks = [b.register_forward_hook(lambda _m, _i, out: outputs.append(out))
             for b in blocks[len(blocks) - n:]]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


def block_tokens(backbone: nn.Module, images: Tensor, n: int) -> tuple[Tensor, list[Tensor]]:
    """``backbone(images)`` and the final-norm tokens (B, prefix + patches, D) of its last ``n``
    blocks, oldest first, from one forward."""
    model = token_model(backbone)
    if model is None:
        raise ValueError(f"{type(backbone).__name__} has no token blocks.")
    with _block_outputs(model, n) as outputs:
        pooled = backbone(images)
    norm = cast(nn.Module, model.norm)
    return pooled, [norm(t) for t in outputs]


def source_features(backbone: nn.Module, images: Tensor, sources: Sequence[Source]
                    ) -> dict[Source, Tensor]:
    """The (B, D_source) features (``tokens``: (B, patches, D_source)) of every source from one
    forward of ``backbone``."""
    depth = max((n for n, pooling in sources if pooling != "pooled"), default=0)
    if depth == 0:
        pooled = backbone(images)
        return {source: pooled for source in sources}
    pooled, tokens = block_tokens(backbone, images, depth)
    prefix = int(cast(nn.Module, token_model(backbone)).num_prefix_tokens)  # type: ignore[arg-type]
    return {(n, pooling): _pool(pooled, tokens[len(tokens) - n:], prefix, pooling)
            for n, pooling in sources}


def _pool(pooled: Tensor, last: list[Tensor], prefix: int, pooling: str) -> Tensor:
    """One source's features from the backbone output and its last blocks' tokens."""
    if pooling == "pooled":
        return pooled
    if pooling == "tokens":
        return torch.cat([t[:, prefix:] for t in last], dim=2)
    cls = [t[:, 0] for t in last]
    means = [t[:, prefix:].mean(dim=1) for t in last]
    if pooling == "cls":
        return torch.cat(cls, dim=1)
    if pooling == "mean":
        return torch.cat(means, dim=1)
    return torch.cat([*cls, means[-1]], dim=1)  # cls+mean


def source_dims(backbone: nn.Module, sources: Sequence[Source], image_size: int = 32
                ) -> dict[Source, int]:
    """The feature size of each source: ``feature_dim`` for ``pooled``; for the token sources
    ``n`` (``cls``, ``mean``, ``tokens``) or ``n + 1`` (``cls+mean``) times the token width."""
    check_sources(backbone, sources)
    dims: dict[Source, int] = {}
    for n, pooling in sources:
        if pooling == "pooled":
            dims[(n, pooling)] = feature_dim(backbone, image_size)
            continue
        model = cast(nn.Module, token_model(backbone))
        width = getattr(model, "embed_dim", None)
        if not isinstance(width, int):
            width = int(model.num_features)  # type: ignore[arg-type]
        dims[(n, pooling)] = (n + (pooling == "cls+mean")) * width
    return dims


def head_param_groups(specs: Sequence[HeadSpec], heads: Sequence[nn.Module],
                      lr_scale: float) -> list[dict]:
    """Per head: its weights with the head's weight decay, its biases (ndim <= 1) with none,
    both at ``lr × lr_scale``; the order of ``specs``."""
    groups = []
    for spec, head in zip(specs, heads, strict=True):
        params = [p for p in head.parameters() if p.requires_grad]
        groups.append({"params": [p for p in params if p.ndim > 1], "lr": spec.lr * lr_scale,
                       "weight_decay": spec.weight_decay})
        groups.append({"params": [p for p in params if p.ndim <= 1], "lr": spec.lr * lr_scale,
                       "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


class LinearHeads(nn.Module):
    """One ``nn.Linear`` per head; the heads of a source run as one matrix product.

    ``forward(features)`` takes :func:`source_features`' dict and returns logits
    (heads, B, classes). The weights of a source's heads are concatenated into one
    (heads·classes, D) matrix for a single ``F.linear``; gradients flow back to each head's own
    parameters. With one head this is exactly ``nn.Linear``.
    """

    def __init__(self, specs: Sequence[HeadSpec], dims: dict[Source, int], num_classes: int,
                 init_std: float = 0.01) -> None:
        super().__init__()
        self.specs = list(specs)
        self.num_classes = num_classes
        linears = [nn.Linear(dims[s.source], num_classes) for s in self.specs]
        self.heads = nn.ModuleList(linears)
        for head in linears:
            if init_std > 0:
                nn.init.normal_(head.weight, std=init_std)
            else:
                nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.members: dict[Source, list[int]] = {}
        for i, spec in enumerate(self.specs):
            self.members.setdefault(spec.source, []).append(i)

    @property
    def sources(self) -> list[Source]:
        return list(self.members)

    def forward(self, features: dict[Source, Tensor]) -> Tensor:
        out: list[Tensor | None] = [None] * len(self.heads)
        c = self.num_classes
        for source, members in self.members.items():
            linears = [cast(nn.Linear, self.heads[i]) for i in members]
            weight = torch.cat([head.weight for head in linears])
            bias = torch.cat([head.bias for head in linears])
            logits = nn.functional.linear(features[source], weight, bias)
            for j, i in enumerate(members):
                out[i] = logits[:, j * c:(j + 1) * c]
        return torch.stack(out)  # type: ignore[arg-type]


class AttentiveHeads(nn.Module):
    """One :class:`AttentivePooling` + ``nn.Linear`` per head of the grid; ``forward`` takes
    :func:`~ssl_lightning.callbacks.probe_grid.source_features`' dict (``tokens`` sources) and
    returns logits (heads, B, classes).

    ``seeded=True`` draws each head's initial weights from a seed of its own (its name's CRC32)
    without touching the global random state: a head starts the same alone or in any grid, and
    on every rank.
    """

    def __init__(self, specs: Sequence[HeadSpec], dims: dict[Source, int], num_classes: int,
                 num_heads: int, num_queries: int, mlp_ratio: float | None = None,
                 seeded: bool = False) -> None:
        super().__init__()
        self.specs = list(specs)
        self.num_classes = num_classes

        def head(spec: HeadSpec) -> nn.Module:
            dim = dims[spec.source]
            return nn.Sequential(AttentivePooling(dim, num_heads, num_queries, mlp_ratio),
                                 nn.Linear(dim, num_classes))

        heads = []
        for spec in self.specs:
            if not seeded:
                heads.append(head(spec))
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(spec.name.encode()))
                heads.append(head(spec))
        self.heads = nn.ModuleList(heads)
        self.sources = list(dict.fromkeys(s.source for s in self.specs))

    def forward(self, features: dict[Source, Tensor]) -> Tensor:
        return torch.stack([head(features[spec.source])
                            for spec, head in zip(self.specs, self.heads, strict=True)])


def format_grid(names: Sequence[str], top1: Sequence[float], best: int) -> str:
    """A table of every head's top-1 (percent), best first, the chosen head marked."""
    order = sorted(range(len(names)), key=lambda i: (-top1[i], i))
    width = max(len(n) for n in names)
    rows = [f"{'*' if i == best else ' '} {names[i]:<{width}}  {top1[i]:6.2f}" for i in order]
    return "\n".join([f"  {'head':<{width}}  top-1 (%)", *rows])
