"""Optimisers and schedules for SSL pre-training: LARS (:mod:`.lars`), parameter groups, the
optimiser factory and lr scaling (:mod:`.param_groups`), per-step schedules (:mod:`.schedules`).
"""

from ssl_lightning.optim.lars import LARS
from ssl_lightning.optim.param_groups import (
    VIT_INPUT_PARAMETERS,
    LRScaling,
    OptimizerName,
    build_optimizer,
    check_layer_decay,
    global_batch_size,
    layer_decay_multipliers,
    scale_lr,
    split_decay_groups,
    vit_depth,
    vit_layer_id,
)
from ssl_lightning.optim.schedules import (
    WarmupCosine,
    WarmupCosineLR,
    cosine_ramp,
    epoch_linspace,
    run_schedule,
    schedule_position,
)

__all__ = [
    "LARS",
    "VIT_INPUT_PARAMETERS",
    "LRScaling",
    "OptimizerName",
    "WarmupCosine",
    "WarmupCosineLR",
    "build_optimizer",
    "check_layer_decay",
    "cosine_ramp",
    "epoch_linspace",
    "global_batch_size",
    "layer_decay_multipliers",
    "run_schedule",
    "scale_lr",
    "schedule_position",
    "split_decay_groups",
    "vit_depth",
    "vit_layer_id",
]
