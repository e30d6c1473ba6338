"""DeepCluster v2 behaviour: a sample's dataset index is recovered from its seed (any seed,
epoch and index); the initial pass (``init_bank="forward"``) fills the bank, before the first
k-means, with every sample's embedding of its epoch-0 views, equal to a float64 loop over the
samples (a tensor dataset with a partial last batch, and the image-folder data module with random
multi-crop views); ``"random"`` keeps the seeded rows; bad settings fail with messages naming
the value (more clusters than training samples before the first step), batches without sample
seeds are refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.clustering import DatasetBank
from ssl_lightning.data import ImageFolderDataModule, MultiCropViews
from ssl_lightning.data.seeding import SeededDataset, sample_index, sample_indices, sample_seed
from ssl_lightning.methods import DeepClusterV2
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import assert_two_processes_equal_one
from ssl_lightning.testing.trainer_runs import KeyedViews, PrecomputedViews, TensorDataModule


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


class _BankAtTrainStart(pl.Callback):
    """Keeps the bank as the first k-means sees it (callbacks run before the module's hook)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.bank = pl_module.bank.embeddings.clone()


def _bank_before_kmeans(model: DeepClusterV2, datamodule: pl.LightningDataModule) -> Tensor:
    capture = _BankAtTrainStart()
    pl.Trainer(accelerator="cpu", max_steps=1, precision="64-true", logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0,
               callbacks=[capture]).fit(model, datamodule=datamodule)
    return capture.bank


def _loop_reference(model: DeepClusterV2, views_of: list[list[Tensor]]) -> Tensor:
    """(2, N, D): every sample's two global crops embedded one at a time in float64,
    backbone -> projector -> z / ||z||."""
    model = copy.deepcopy(model).double()
    rows = [[], []]
    with torch.no_grad():
        for views in views_of:
            for crop in range(2):
                z = model.projector(model.backbone(views[crop][None].double()))[0]
                rows[crop].append(z / z.pow(2).sum().sqrt())
    return torch.stack([torch.stack(r) for r in rows])


def test_forward_init_embeds_every_sample() -> None:
    data = KeyedViews(10, dtype=torch.float64)  # batches of 4: the pass also covers 8 and 9
    model = _method(num_prototypes=(3,))
    expected = _loop_reference(model, [data[i][0] for i in range(len(data))])
    bank = _bank_before_kmeans(model, TensorDataModule(data, 4))
    assert float((bank - expected).abs().max()) < 1e-12


def test_forward_init_with_the_image_folder_data_module(tmp_path: Path,
                                                        make_image_folder) -> None:  # type: ignore[no-untyped-def]
    root = make_image_folder(tmp_path / "train", classes=2, per_class=7)
    views = MultiCropViews("dino", "cifar", num_local_crops=2, global_size=16, local_size=8)
    data = ImageFolderDataModule(str(root), preset="cifar", batch_size=4, num_workers=0,
                                 train_transform=views, seed=3)
    pl.seed_everything(0, verbose=False)
    model = _method(num_prototypes=(3,))
    reference = copy.deepcopy(model)
    bank = _bank_before_kmeans(model, data)
    seeded = SeededDataset(data.train_dataset, 3)  # epoch 0's random views of each sample
    expected = _loop_reference(reference, [seeded[(0, i)][0] for i in range(14)])
    assert float((bank - expected).abs().max()) < 1e-12


def test_random_init_keeps_the_seeded_rows() -> None:
    bank = _bank_before_kmeans(_method(num_prototypes=(3,), init_bank="random"),
                               TensorDataModule(KeyedViews(10, dtype=torch.float64), 4))
    assert torch.equal(bank, DatasetBank(2, 4, 10).embeddings.double())


def test_bad_settings_fail() -> None:
    with pytest.raises(ValueError, match=r"num_prototypes .* got \[\]"):
        _method(num_prototypes=())
    with pytest.raises(ValueError, match="kmeans_iterations must be >= 1, got 0"):
        _method(kmeans_iterations=0)
    with pytest.raises(ValueError, match="init_bank must be 'forward' or 'random', got 'zeros'"):
        _method(init_bank="zeros")
    with pytest.raises(ValueError, match=r"num_prototypes=\[30\] asks for more clusters than "
                                         "the 24 training samples"):
        _fit(_method(num_prototypes=(30,)), KeyedViews(24))


def test_batches_without_sample_seeds_are_refused() -> None:
    with pytest.raises(ValueError, match="package's data modules"):
        _fit(_method(num_prototypes=(3,)), PrecomputedViews(24))


class _LocalBank(DatasetBank):
    """Known-bad: k-means statistics of this rank's rows only (no sum over ranks)."""

    def reduce(self, x: Tensor) -> Tensor:
        return x


class _LocalInitDeepClusterV2(DeepClusterV2):
    """Known-bad: the initial pass writes this rank's rows only (the other rows stay random)."""

    _local_rows = False

    def fill_bank(self) -> None:
        self._local_rows = True
        try:
            super().fill_bank()
        finally:
            self._local_rows = False

    def gather_no_grad(self, x: Tensor) -> Tensor:
        return x if self._local_rows else super().gather_no_grad(x)


DDP_OPTIM = dict(optimizer="sgd", lr=0.5, lr_scaling="none", warmup_epochs=0)


def _local_kmeans() -> DeepClusterV2:
    model = method_entry("deepcluster_v2").small(init_bank="forward", **DDP_OPTIM)
    model.bank.__class__ = _LocalBank
    return model


def _local_initial_bank() -> DeepClusterV2:
    model = method_entry("deepcluster_v2").small(init_bank="forward", **DDP_OPTIM)
    model.__class__ = _LocalInitDeepClusterV2
    return model


@pytest.mark.slow
@pytest.mark.parametrize("known_bad", [_local_kmeans, _local_initial_bank],
                         ids=["kmeans-of-each-rank", "initial-bank-of-each-rank"])
def test_clustering_each_ranks_rows_alone_differs_from_one_process(known_bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AssertionError, match="2 processes differ from 1 process"):
        assert_two_processes_equal_one(known_bad, KeyedViews(24, (8, 8, 4)))
