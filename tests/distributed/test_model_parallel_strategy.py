"""Lightning's own ``ModelParallelStrategy`` (as its docs show it) is refused before training,
naming ``configs/shared/fsdp.yaml``: under it DINO could not resume (its last layer, frozen in
the first epoch, had no optimiser state in the checkpoint). ``ShardedStrategy`` resumes it
(``tests/distributed/test_sharded_training.py``)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.strategies import ModelParallelStrategy
from sharding_harness import VIEWS, make_method

from ssl_lightning.testing.trainer_runs import KeyedViews, TensorDataModule


def test_lightnings_model_parallel_strategy_is_refused_before_training() -> None:
    model = make_method("dino")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         strategy=ModelParallelStrategy(data_parallel_size=1,
                                                        tensor_parallel_size=1))
    started = dist.is_initialized()
    try:
        with pytest.raises(ValueError,
                           match=r"ModelParallelStrategy: .*configs/shared/fsdp\.yaml"):
            trainer.fit(model, TensorDataModule(KeyedViews(8, VIEWS["dino"]), 4))
    finally:
        if dist.is_initialized() and not started:  # the strategy's 1-process group
            dist.destroy_process_group()
    assert trainer.global_step == 0
