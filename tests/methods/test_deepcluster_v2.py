"""DeepCluster v2 behaviour: a sample's dataset index is recovered from its seed (any seed,
epoch and index), bad settings fail with messages naming the value (more clusters than training
samples before the first step), batches without sample seeds are refused."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from lightning_ddp_utils import KeyedViews, PrecomputedViews, TensorDataModule

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.data.seeding import sample_index, sample_indices, sample_seed
from ssl_lightning.methods import DeepClusterV2


def _method(**kwargs) -> DeepClusterV2:  # type: ignore[no-untyped-def]
    return DeepClusterV2(SmallConvNet((4, 8), norm="group"), projection_hidden_dim=8,
                         projection_dim=4, head_batch_norm=False, optimizer="sgd", lr=0.1,
                         warmup_epochs=0, **kwargs)


def _fit(model: DeepClusterV2, data) -> None:  # type: ignore[no-untyped-def]
    pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(
        model, datamodule=TensorDataModule(data, 4))


@pytest.mark.parametrize(("seed", "epoch"), [(0, 0), (7, 3), (2**40 + 1, 120)])
def test_sample_indices_invert_the_sample_seed(seed: int, epoch: int) -> None:
    indices = torch.tensor([0, 1, 999, 49_999, 31_337])
    seeds = torch.tensor([sample_seed(seed, epoch, int(i)) for i in indices])
    assert torch.equal(sample_indices(seeds, seed, epoch, 50_000), indices)
    with pytest.raises(ValueError, match="in epoch 1 with seed"):
        sample_index(int(seeds[2]), seed, 1, 50_000)  # another epoch's seed


def test_bad_settings_fail() -> None:
    with pytest.raises(ValueError, match=r"num_prototypes .* got \[\]"):
        _method(num_prototypes=())
    with pytest.raises(ValueError, match="kmeans_iterations must be >= 1, got 0"):
        _method(kmeans_iterations=0)
    with pytest.raises(ValueError, match=r"num_prototypes=\[30\] asks for more clusters than "
                                         "the 24 training samples"):
        _fit(_method(num_prototypes=(30,)), KeyedViews(24))


def test_batches_without_sample_seeds_are_refused() -> None:
    with pytest.raises(ValueError, match="package's data modules"):
        _fit(_method(num_prototypes=(3,)), PrecomputedViews(24))
