"""Parameter groups, the optimiser factory and the lr scaling rule.

- Weights with weight decay, biases and norms without (and excluded from LARS's trust ratio).
- Layer-wise lr decay for ViTs (Bao et al., "BEiT: BERT Pre-Training of Image Transformers",
  ICLR 2022; DINOv2's ``get_vit_lr_decay_rate``): a per-group ``lr_multiplier`` on the peak lr,
  see docs/optimisation_schedules.md.
- Learning-rate scaling rule: ``lr = base_lr × global_batch / 256`` ("linear", Goyal et al.) or
  ``base_lr × sqrt(global_batch)`` ("sqrt", SimCLR §B.1 for LARS with large batches).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from ssl_lightning.optim.lars import LARS

if TYPE_CHECKING:
    import pytorch_lightning as pl

OptimizerName = Literal["lars", "sgd", "adamw"]
LRScaling = Literal["none", "linear", "sqrt"]


def split_decay_groups(
    modules: Iterable[nn.Module],
    weight_decay: float,
    lr_multipliers: Mapping[int, float] | None = None,
) -> list[dict]:
    """Weights with decay, and biases/norm parameters (ndim <= 1) without.

    The no-decay group is also marked ``exclude_from_lars``; the decay group
    ``weight_decay_schedule`` (the groups a cosine weight-decay schedule changes). Frozen
    parameters are skipped. Without ``lr_multipliers``: these two groups. With them
    (``id(parameter) -> factor``, 1 for a parameter not in it, see
    :func:`layer_decay_multipliers`): one such pair per distinct factor, in order of first
    appearance, each marked ``lr_multiplier`` (empty groups left out).
    """
    pairs: dict[float, tuple[list[nn.Parameter], list[nn.Parameter]]] = {}
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            factor = 1.0 if lr_multipliers is None else lr_multipliers.get(id(p), 1.0)
            decay, no_decay = pairs.setdefault(factor, ([], []))
            (no_decay if p.ndim <= 1 else decay).append(p)
    if lr_multipliers is None:
        decay, no_decay = pairs.get(1.0, ([], []))
        return [
            {"params": decay, "weight_decay": weight_decay, "weight_decay_schedule": True},
            {"params": no_decay, "weight_decay": 0.0, "exclude_from_lars": True},
        ]
    groups: list[dict] = []
    for factor, (decay, no_decay) in pairs.items():
        if decay:
            groups.append({"params": decay, "weight_decay": weight_decay,
                           "weight_decay_schedule": True, "lr_multiplier": factor})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0, "exclude_from_lars": True,
                           "lr_multiplier": factor})
    return groups


#: Parameters of a ViT that sit before the first block (layer 0 of layer-wise lr decay).
VIT_INPUT_PARAMETERS = ("patch_embed", "cls_token", "pos_embed", "register_tokens", "mask_token")


def vit_depth(backbone: nn.Module, argument: str = "layer_decay") -> int:
    """Number of transformer blocks of a ViT backbone, or a ``ValueError`` naming
    ``argument`` for a backbone without ``blocks`` and ``patch_embed`` (not a ViT)."""
    blocks = getattr(backbone, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not hasattr(backbone, "patch_embed"):
        raise ValueError(
            f"{argument} needs a ViT backbone with transformer blocks (ssl_lightning ViT: "
            f"patch_embed, blocks); {type(backbone).__name__} has none. Set {argument}: 1.0 "
            "for this backbone."
        )
    return len(blocks)


def check_layer_decay(backbone: nn.Module, layer_decay: float,
                      patch_embed_multiplier: float) -> None:
    """``ValueError`` unless ``0 < layer_decay <= 1``, ``patch_embed_multiplier > 0`` and, when
    either is not 1, ``backbone`` is a ViT (:func:`vit_depth`)."""
    if not 0 < layer_decay <= 1:
        raise ValueError(f"layer_decay must be in (0, 1] (1: no layer-wise decay), got "
                         f"{layer_decay}.")
    if not patch_embed_multiplier > 0:
        raise ValueError(f"patch_embed_lr_multiplier must be > 0, got {patch_embed_multiplier}.")
    for name, value in (("layer_decay", layer_decay),
                        ("patch_embed_lr_multiplier", patch_embed_multiplier)):
        if value != 1:
            vit_depth(backbone, name)


def vit_layer_id(name: str, depth: int) -> int:
    """Layer of the ViT parameter ``name`` (relative to the ViT): 0 for the patch embedding and
    the [CLS], position, register and mask tokens, ``i + 1`` for block ``i``, ``depth + 1``
    for the rest (the final norm)."""
    first, _, rest = name.partition(".")
    if first in VIT_INPUT_PARAMETERS:
        return 0
    if first == "blocks":
        return int(rest.partition(".")[0]) + 1
    return depth + 1


def layer_decay_multipliers(
    backbone: nn.Module, layer_decay: float, patch_embed_multiplier: float = 1.0
) -> dict[int, float]:
    """``id(parameter) -> layer_decay ** (depth + 1 − layer)`` for every ViT parameter
    (:func:`vit_layer_id`), × ``patch_embed_multiplier`` for the patch embedding. Parameters
    outside the backbone (heads) keep factor 1, like the final norm."""
    depth = vit_depth(backbone)
    multipliers = {}
    for name, p in backbone.named_parameters():
        factor = layer_decay ** (depth + 1 - vit_layer_id(name, depth))
        if name.startswith("patch_embed."):
            factor *= patch_embed_multiplier
        multipliers[id(p)] = factor
    return multipliers


def build_optimizer(
    name: OptimizerName,
    param_groups: list[dict],
    lr: float,
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    trust_coefficient: float = 0.001,
) -> Optimizer:
    """Build LARS, SGD or AdamW over ``param_groups`` (from :func:`split_decay_groups`); a group
    with an ``lr_multiplier`` gets ``lr × lr_multiplier`` as its (peak) lr."""
    param_groups = [{**g, "lr": lr * g["lr_multiplier"]} if "lr_multiplier" in g else g
                    for g in param_groups]
    if name == "lars":
        return LARS(param_groups, lr=lr, momentum=momentum, trust_coefficient=trust_coefficient)
    groups = [{k: v for k, v in g.items() if k != "exclude_from_lars"} for g in param_groups]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    raise ValueError(f"Unknown optimizer {name!r}; choose 'lars', 'sgd' or 'adamw'.")


def scale_lr(base_lr: float, global_batch_size: int, rule: LRScaling) -> float:
    """Apply the batch-size scaling rule to a base learning rate."""
    if rule == "linear":
        return base_lr * global_batch_size / 256
    if rule == "sqrt":
        return base_lr * math.sqrt(global_batch_size)
    if rule == "none":
        return base_lr
    raise ValueError(f"Unknown lr scaling rule {rule!r}; choose 'none', 'linear' or 'sqrt'.")


def global_batch_size(trainer: pl.Trainer, lr_scaling: LRScaling = "linear") -> int:
    """Per-device batch × world size × gradient-accumulation steps, from the train loader.

    Raises:
        ValueError: the loader has no integer ``batch_size`` (a sampler that batches itself)
            and ``lr_scaling`` needs the batch; with ``lr_scaling="none"`` the result is 1.
    """
    batch_size = getattr(trainer.train_dataloader, "batch_size", None)
    if not isinstance(batch_size, int):
        if lr_scaling == "none":
            return 1
        raise ValueError(
            "Cannot read the batch size from the train dataloader to apply lr_scaling="
            f"{lr_scaling!r}; set lr_scaling: none and give the final lr."
        )
    return batch_size * trainer.world_size * trainer.accumulate_grad_batches
