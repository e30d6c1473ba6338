"""Checks and building blocks for testing a method, the shipped ones' and one's own.

- :mod:`~ssl_lightning.testing.checks`: :func:`assert_micro_batches_equal_whole_batch`,
  :func:`assert_two_processes_equal_one`, :func:`assert_resume_is_exact` (float64, CPU).
- :mod:`~ssl_lightning.testing.trainer_runs`: deterministic view datasets
  (:class:`PrecomputedViews`, :class:`KeyedViews`), :class:`TensorDataModule`,
  :class:`ViewsDataModule` (resumable inside an epoch),
  :func:`ddp_global_order`, :func:`fit_and_dump` and state comparisons.
- :mod:`~ssl_lightning.testing.differences`: which states differ and by how much.
- :mod:`~ssl_lightning.testing.process_pool`: the reusable 2-process gloo pool the 2-process
  check runs in.
"""

from ssl_lightning.testing.checks import (
    BatchesDataModule,
    assert_micro_batches_equal_whole_batch,
    assert_resume_is_exact,
    assert_two_processes_equal_one,
)
from ssl_lightning.testing.trainer_runs import (
    KeyedViews,
    PrecomputedViews,
    TensorDataModule,
    ViewsDataModule,
    ddp_global_order,
    fit_and_dump,
    max_relative_difference,
)

__all__ = [
    "BatchesDataModule",
    "KeyedViews",
    "PrecomputedViews",
    "TensorDataModule",
    "ViewsDataModule",
    "assert_micro_batches_equal_whole_batch",
    "assert_resume_is_exact",
    "assert_two_processes_equal_one",
    "ddp_global_order",
    "fit_and_dump",
    "max_relative_difference",
]
