"""Work across processes: the collectives of the losses and methods (:mod:`.collectives`,
re-exported here, so ``from ssl_lightning.distributed import all_gather_with_grad`` works) and
sharded (FSDP2) training and checkpoints (:mod:`ssl_lightning.distributed.sharding`, imported
from there: it needs Lightning's ``ModelParallelStrategy``, the collectives do not)."""

from ssl_lightning.distributed.collectives import (
    all_gather_no_grad,
    all_gather_with_grad,
    all_reduce_mean_no_grad,
    all_reduce_sum_no_grad,
    all_reduce_sum_with_grad,
    contiguous_grad,
    destroy_process_group_at_exit,
    flatten_gathered,
    is_distributed,
    rank,
    sampler_order,
    world_size,
)

__all__ = [
    "all_gather_no_grad",
    "all_gather_with_grad",
    "all_reduce_mean_no_grad",
    "all_reduce_sum_no_grad",
    "all_reduce_sum_with_grad",
    "contiguous_grad",
    "destroy_process_group_at_exit",
    "flatten_gathered",
    "is_distributed",
    "rank",
    "sampler_order",
    "world_size",
]
