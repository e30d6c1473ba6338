"""Argument types and checks of :class:`~ssl_lightning.methods.DINO` and its presets.

Each check raises a ``ValueError`` naming the value before anything is built, and an argument of
a switched-off loss term (a ``patch_*`` / ``mask_*`` argument without ``patch_distillation``, a
``gram_*`` argument without ``gram_anchoring``, a ``paka_*`` argument with ``paka_weight`` 0) is
refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch import nn

ClipMode = Literal["per_parameter", "per_module"]
KoLeoScope = Literal["global", "local"]
GramTokens = Literal["all", "masked", "unmasked"]

#: Arguments that only apply with ``patch_distillation`` (iBOT's masked-patch loss).
PATCH_ARGUMENTS = ("patch_out_dim", "shared_head", "patch_hidden_dim", "patch_bottleneck_dim",
                   "patch_student_temperature", "patch_teacher_temperature",
                   "warmup_patch_teacher_temperature", "patch_center_momentum",
                   "patch_loss_weight", "patch_visible_weight", "mask_ratio", "mask_probability",
                   "mask_min_patches", "mask_ratio_stratified")
#: Arguments that only apply with ``gram_anchoring`` (DINOv3's Gram loss).
GRAM_ARGUMENTS = ("gram_weight", "gram_start_step", "gram_refresh_every", "gram_max_refreshes",
                  "gram_weight_ramp_steps", "gram_tokens", "gram_clamp_negatives")

#: Arguments that only apply with ``paka_weight`` > 0 (PaKA's patch kernel alignment).
PAKA_ARGUMENTS = ("paka_hidden_dim", "paka_dim", "paka_views", "paka_local_crops")


def check_dino_arguments(name: str, backbone: nn.Module, args: Mapping[str, Any],
                         defaults: Mapping[str, Any]) -> None:
    """Validate the constructor arguments ``args`` of the DINO-family class ``name``
    (``defaults``: the constructor's defaults, to find arguments of a switched-off term)."""
    _refuse_unused(args, defaults, "patch_distillation", PATCH_ARGUMENTS)
    _refuse_unused(args, defaults, "gram_anchoring", GRAM_ARGUMENTS)
    if args["paka_weight"] < 0:
        raise ValueError(f"paka_weight must be >= 0 (0: no PaKA term), got {args['paka_weight']}.")
    changed = [n for n in PAKA_ARGUMENTS if args[n] != defaults[n]]
    if args["paka_weight"] == 0 and changed:
        raise ValueError(f"{', '.join(changed)} only apply with paka_weight > 0 (got 0); set "
                         "paka_weight or leave them out.")
    _positive(args, "teacher_temperature", "warmup_teacher_temperature")
    for arg in ("warmup_teacher_temperature_epochs", "freeze_last_layer_epochs"):
        if args[arg] < 0:
            raise ValueError(f"{arg} must be >= 0, got {args[arg]}.")
    if args["clip_grad"] is not None and not args["clip_grad"] > 0:
        raise ValueError(f"clip_grad must be > 0 or None, got {args['clip_grad']}.")
    if args["clip_grad_mode"] not in ("per_parameter", "per_module"):
        raise ValueError(f"clip_grad_mode must be 'per_parameter' or 'per_module', got "
                         f"{args['clip_grad_mode']!r}.")
    if args["num_local_crops"] is not None and args["num_local_crops"] < 0:
        raise ValueError(f"num_local_crops must be >= 0 or None, got {args['num_local_crops']}.")
    if args["koleo_weight"] < 0:
        raise ValueError(f"koleo_weight must be >= 0, got {args['koleo_weight']}.")
    if args["koleo_scope"] not in ("global", "local"):
        raise ValueError(f"koleo_scope must be 'global' or 'local', got {args['koleo_scope']!r}.")
    if args["patch_distillation"]:
        _check_patch_arguments(name, backbone, args)
    if args["gram_anchoring"]:
        _check_gram_arguments(name, args)
    if args["paka_weight"] > 0:
        _check_paka_arguments(name, args)
    _check_matryoshka_arguments(args)
    if args["mixed_resolution_sizes"] is not None and args["num_local_crops"] is None:
        raise ValueError(f"{name} needs num_local_crops (an int) with mixed_resolution_sizes: "
                         "the local crops are resized to the step's local size.")


def require_local_crops(name: str, num_local_crops: int | None) -> None:
    """DINOv2's and DINOv3's recipes train with local crops."""
    if num_local_crops is not None and num_local_crops < 1:
        raise ValueError(f"{name} trains with local crops: num_local_crops must be >= 1 "
                         f"(or None), got {num_local_crops}.")


def _refuse_unused(args: Mapping[str, Any], defaults: Mapping[str, Any], switch: str,
                   names: tuple[str, ...]) -> None:
    if args[switch]:
        return
    changed = [n for n in names if _plain(args[n]) != _plain(defaults[n])]
    if changed:
        raise ValueError(f"{', '.join(changed)} only apply with {switch}=True (got "
                         f"{switch}=False); set {switch}: true or leave them out.")


def _plain(value: Any) -> Any:
    """Lists (from a config) compare equal to the tuples of the defaults."""
    return tuple(value) if isinstance(value, list) else value


def _positive(args: Mapping[str, Any], *names: str) -> None:
    for arg in names:
        if not args[arg] > 0:
            raise ValueError(f"{arg} must be > 0, got {args[arg]}.")


def _check_patch_arguments(name: str, backbone: nn.Module, args: Mapping[str, Any]) -> None:
    if not all(hasattr(backbone, a) for a in ("forward_tokens", "num_prefix_tokens")):
        raise ValueError(f"{name} needs a ViT backbone with patch tokens (ssl_lightning.ViT),"
                         f" got {type(backbone).__name__}.")
    if getattr(backbone, "mask_token", None) is None:
        raise ValueError(f"{name} needs a ViT built with mask_token=True (the student's "
                         "masked patches are replaced by it); set backbone mask_token: true.")
    if args["head_batch_norm"]:
        raise ValueError(f"{name} heads also run on patch tokens: head_batch_norm must be false.")
    if args["shared_head"] and (args["patch_hidden_dim"], args["patch_bottleneck_dim"]) != (
            None, None):
        raise ValueError("A shared head has one size: patch_hidden_dim and "
                         "patch_bottleneck_dim must be None (or set shared_head: false).")
    if args["shared_head"] and args["patch_out_dim"] not in (None, args["head_out_dim"]):
        raise ValueError(f"A shared head has one output size: patch_out_dim "
                         f"({args['patch_out_dim']}) must be None or equal head_out_dim "
                         f"({args['head_out_dim']}).")
    _positive(args, "patch_teacher_temperature", "warmup_patch_teacher_temperature")
    if args["patch_loss_weight"] < 0:
        raise ValueError(f"patch_loss_weight must be >= 0, got {args['patch_loss_weight']}.")
    low, high = args["mask_ratio"]
    if not 0 <= low <= high <= 1:
        raise ValueError(f"mask_ratio must satisfy 0 <= low <= high <= 1, got "
                         f"{args['mask_ratio']}.")
    if not 0 <= args["mask_probability"] <= 1:
        raise ValueError(f"mask_probability must be in [0, 1], got {args['mask_probability']}.")
    if args["mask_min_patches"] < 1:
        raise ValueError(f"mask_min_patches must be >= 1, got {args['mask_min_patches']}.")


def _check_paka_arguments(name: str, args: Mapping[str, Any]) -> None:
    if not args["patch_distillation"]:
        raise ValueError(f"{name}'s PaKA term aligns the student's and teacher's patch tokens of "
                         "the global crops: set patch_distillation: true (or paka_weight: 0).")
    for arg in ("paka_hidden_dim", "paka_dim", "paka_local_crops"):
        if args[arg] < 1:
            raise ValueError(f"{arg} must be >= 1, got {args[arg]}.")
    if args["paka_views"] not in ("same", "across"):
        raise ValueError(f"paka_views must be 'same' or 'across', got {args['paka_views']!r}.")
    if args["paka_views"] == "across" and (
            args["num_local_crops"] is None or args["gram_anchoring"]
            or args["mixed_resolution_sizes"] is not None):
        raise ValueError(f"{name} with paka_views: across needs num_local_crops (an int: the "
                         "PaKA crops follow the DINO views), and no gram_anchoring or "
                         "mixed_resolution_sizes; train_transform: PaKAViews.")


def _check_matryoshka_arguments(args: Mapping[str, Any]) -> None:
    levels = args["matryoshka_levels"]
    if not isinstance(levels, int) or levels < 1:
        raise ValueError(f"matryoshka_levels must be an int >= 1 (1: one head; Franca: 5), got "
                         f"{levels!r}.")
    if levels > 1 and args["head_batch_norm"]:
        raise ValueError("Matryoshka heads have no BatchNorm: set head_batch_norm: false or "
                         "matryoshka_levels: 1.")


def _check_gram_arguments(name: str, args: Mapping[str, Any]) -> None:
    if args["gram_weight"] < 0:
        raise ValueError(f"gram_weight must be >= 0, got {args['gram_weight']}.")
    if args["gram_weight_ramp_steps"] < 0:
        raise ValueError(f"gram_weight_ramp_steps must be >= 0, got "
                         f"{args['gram_weight_ramp_steps']}.")
    if args["gram_tokens"] not in ("all", "masked", "unmasked"):
        raise ValueError(f"gram_tokens must be 'all', 'masked' or 'unmasked', got "
                         f"{args['gram_tokens']!r}.")
    if args["num_local_crops"] is None:
        raise ValueError(f"{name} needs num_local_crops (an int): the views after the local "
                         "crops are the Gram-teacher crops.")
    if not args["patch_distillation"]:
        raise ValueError(f"{name}'s Gram anchoring compares the student's patch tokens of its "
                         "masked global crops: set patch_distillation: true.")
