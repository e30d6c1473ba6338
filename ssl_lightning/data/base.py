"""SSLDataModule: the loaders and checks shared by every data module.

A subclass only says where its datasets come from (:meth:`SSLDataModule.build_train` and
:meth:`SSLDataModule.build_eval`); batching, the deterministic kNN-bank subset, the
batch-size check, the evaluation-data checks (:mod:`ssl_lightning.data.checks`) and the
``[train_eval_loader, val_loader]`` validation pair (in a fixed class-balanced order) live here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from ssl_lightning._lightning import pl, rank_zero_warn, restored_checkpoint
from ssl_lightning.data.checks import (
    balanced_order,
    check_eval_classes,
    check_image_sizes,
    check_view_sizes,
    train_view_size,
)
from ssl_lightning.data.datasets import SKIPPED_IMAGES, OnError, UnreadableImages
from ssl_lightning.data.device_views import DeviceViews, UInt8Image
from ssl_lightning.data.fingerprint import dataset_fingerprint
from ssl_lightning.data.multichannel_device_views import ArrayImage
from ssl_lightning.data.preprocessing import eval_transform as preprocessing_transform
from ssl_lightning.data.seeding import EpochSampler, SeededDataset
from ssl_lightning.data.transforms import EvalTransform, MultiViewTransform, PresetName, SimCLRViews
from ssl_lightning.data.worker_signals import ignore_stop_signals


class SSLDataModule(pl.LightningDataModule):
    """Base data module for self-supervised pre-training.

    Training batches are ``(views, targets, sample_seeds)``: ``views`` a list of (B, C, H, W)
    tensors from ``train_transform``, ``targets`` a LongTensor (-1 for unlabeled images),
    ``sample_seeds`` the (B,) int64 seeds of the samples (the methods' masks and stochastic
    depth derive from them, :mod:`ssl_lightning.training.sample_rng`). ``val_dataloader``
    returns ``[train_eval_loader, val_loader]`` of single eval-transformed labeled images:
    dataloader 0 is the kNN memory bank / probe reference (train split), 1 the queries (val
    split), both in a fixed class-balanced order (:func:`~ssl_lightning.data.checks.balanced_order`,
    so ``limit_val_batches`` still sees every class); it returns ``[]`` when there is no labeled
    data to evaluate on. ``setup`` refuses evaluation splits with different class folders, a
    single class or more classes than ``num_classes`` (:mod:`ssl_lightning.data.checks`).

    Args:
        batch_size: Batch size per device (the global batch is this × devices × nodes).
        num_workers: Data-loading worker processes per device.
        pin_memory: Pin host memory for faster GPU copies (ignored without CUDA).
        persistent_workers: Keep workers alive between epochs (only with num_workers > 0).
        prefetch_factor: Batches loaded in advance by each worker (only with num_workers > 0).
        drop_last: Drop the last incomplete training batch (keeps every step's batch equal, which
            the exact-DDP losses assume).
        train_transform: Image -> list of views; ``SimCLRViews(preset)`` if None.
        eval_transform: Image -> tensor for the validation loaders; ``EvalTransform(preset)``
            if None.
        knn_train_subset: Use only this many train images (a fixed random subset, the same on
            every run) as the kNN bank; None uses all. For cheap CPU runs.
        eval_batch_size: Batch size of the validation loaders; ``batch_size`` if None.
        preset: Transform preset used for the default transforms.
        device_transform: Make the training views on the accelerator, batched, from uint8
            images (:class:`DeviceViews`, in ``on_after_batch_transfer``; the default
            ``train_transform`` then only decodes, :class:`UInt8Image`) or from float arrays of
            any channel count (:class:`MultiChannelDeviceViews`, decoded by
            :class:`ArrayImage`).
        batched_views_on: Where ``device_transform`` runs: ``"device"`` (after the batch is
            on the accelerator), ``"workers"`` (in the loader workers' collate step, on CPU:
            batched augmentation without accelerator time) or ``"auto"``: the workers when
            training on CPU (or without a trainer), else the device. The views are the same
            either way. The shipped SimCLR-recipe configs (simclr, dcl, supcon, moco_v2,
            simsiam) set ``DeviceViews`` with ``"auto"``.
        seed: Seed of the training order and augmentations (both pure functions of seed, epoch,
            sample index and view; see ``docs/resume.md``); None takes ``seed_everything``'s
            seed (``PL_GLOBAL_SEED``), else 0. Saved in checkpoints and restored on resume.
        on_error: What an image file that cannot be decoded does: ``"skip"`` warns, lists it
            in ``skipped_images.txt`` in the run's log directory and uses another image of the
            dataset, chosen from the sample's seed (so resume stays exact); ``"raise"`` stops
            with an error naming the file (:class:`~ssl_lightning.data.datasets.UnreadableImages`).
        max_corrupt_fraction: With ``on_error: skip``, stop once more than this fraction of a
            dataset's images are unreadable.
    """

    #: Number of classes of the labeled splits (None when unknown or unlabeled).
    num_classes: int | None = None

    def __init__(
        self,
        batch_size: int = 256,
        num_workers: int = 4,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
        drop_last: bool = True,
        train_transform: MultiViewTransform | None = None,
        eval_transform: EvalTransform | None = None,
        knn_train_subset: int | None = None,
        eval_batch_size: int | None = None,
        preset: PresetName = "cifar",
        device_transform: DeviceViews | None = None,
        batched_views_on: Literal["auto", "device", "workers"] = "auto",
        seed: int | None = None,
        on_error: OnError = "skip",
        max_corrupt_fraction: float = 0.01,
    ) -> None:
        super().__init__()
        for name, value in [("batch_size", batch_size), ("prefetch_factor", prefetch_factor),
                            ("knn_train_subset", knn_train_subset),
                            ("eval_batch_size", eval_batch_size)]:
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.drop_last = drop_last
        self.device_transform = device_transform
        if batched_views_on not in ("auto", "device", "workers"):
            raise ValueError(f"batched_views_on must be 'auto', 'device' or 'workers', got "
                             f"{batched_views_on!r}.")
        self.batched_views_on = batched_views_on
        if device_transform is not None and train_transform is not None and not isinstance(
                train_transform, (UInt8Image, ArrayImage)):
            raise ValueError(
                f"train_transform={type(train_transform).__name__} makes views itself, but "
                f"device_transform={type(device_transform).__name__} makes them from the "
                "decoded images (train_transform UInt8Image, the default with a "
                "device_transform, or ArrayImage for multi-channel arrays). Set "
                "device_transform: null to use your train_transform, or leave train_transform "
                "unset.")
        self.train_transform = train_transform or (
            UInt8Image.for_preset(preset) if device_transform is not None else SimCLRViews(preset))
        self.eval_transform = eval_transform or EvalTransform(preset)
        self._eval_transform_given = eval_transform is not None
        self._train_transform_given = train_transform is not None
        self._preset: PresetName = preset
        self.knn_train_subset = knn_train_subset
        self.seed = seed
        self.unreadable = UnreadableImages(on_error, max_corrupt_fraction)
        self._restored_seed: int | None = None
        self._restored_loader: dict[str, Any] | None = None
        self._restored_fingerprint: str | None = None
        self._restored = False
        self._fingerprint: str | None = None  # of train_dataset, computed once when needed
        self._train_loader: StatefulDataLoader | None = None
        self._views_made_in_workers = False
        self.train_dataset: Dataset | None = None
        self.eval_datasets: tuple[Dataset, Dataset] | None = None

    # ------------------------------------------------------------------ to implement
    def build_train(self, transform: MultiViewTransform) -> Dataset:
        """The pre-training dataset, yielding ``(views, target)`` through ``transform``."""
        raise NotImplementedError

    def build_eval(self, transform: EvalTransform) -> tuple[Dataset, Dataset] | None:
        """Labeled ``(bank, queries)`` datasets for kNN / probe evaluation, or None."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        if isinstance(self.trainer, pl.Trainer):  # every rank reads it (a collective under DDP)
            log_dir = self.trainer.log_dir or self.trainer.default_root_dir
            self.unreadable.record = Path(log_dir) / SKIPPED_IMAGES
            self._adopt_checkpoint_preprocessing(self.trainer.lightning_module)
        new_train = stage in ("fit", None) and self.train_dataset is None
        if new_train:
            self.train_dataset = self.build_train(self.train_transform)
            self._check_batch_size(self.train_dataset)
            check_image_sizes(self.train_dataset, train_view_size(
                self.train_transform, getattr(self.device_transform, "crop_size", None)))
        if stage in ("fit", "validate", None) and self.eval_datasets is None:
            splits = self.build_eval(self.eval_transform)
            if splits is not None:
                bank, queries = splits
                check_eval_classes(bank, queries, self.num_classes, type(self).__name__)
                self.eval_datasets = (self._bank_subset(bank), queries)
        if new_train and self.eval_datasets is not None:
            crop = getattr(self.device_transform, "crop_size", None)
            check_view_sizes(self.train_transform, self.eval_transform, crop)

    def _adopt_checkpoint_preprocessing(self, module: Any) -> None:
        """Evaluate with the preprocessing the module's checkpoint records (its
        ``checkpoint_preprocessing``: ``LinearEval``, ``KNNEval``) when no ``eval_transform`` was
        given and the record is of RGB images (:mod:`ssl_lightning.data.preprocessing`); train
        on the module's ``training_views`` (``LinearEval``: the recorded crop and statistics)
        when no ``train_transform`` (nor ``device_transform``) was given."""
        record = getattr(module, "checkpoint_preprocessing", None)
        if (record is not None and not self._eval_transform_given and self.eval_datasets is None
                and record.get("image_reader") == "rgb"):
            self.eval_transform = preprocessing_transform(record)
        training_views = getattr(module, "training_views", None)
        if (callable(training_views) and not self._train_transform_given
                and self.device_transform is None and self.train_dataset is None):
            self.train_transform = training_views(self._preset)

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        return self._make_train_loader(cast(Dataset, self.train_dataset))

    def val_dataloader(self) -> list[DataLoader]:
        if self.eval_datasets is None:
            self.setup("validate")
        if self.eval_datasets is None:
            return []
        # A fixed class-balanced order, so that limit_val_batches still sees every class.
        return [self._loader(Subset(d, balanced_order(d)), self.eval_batch_size, train=False)
                for d in self.eval_datasets]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Turn the uint8 training batch into views when ``device_transform`` is set."""
        if self.device_transform is None or self.trainer is None or not self.trainer.training:
            return batch
        views, targets, *seeds = batch  # (views, targets, per-sample seeds) of SeededDataset
        if self._views_made_in_workers:
            return batch  # by the loader's BatchedViewsCollate
        return self.device_transform(views[0], seeds=seeds[0] if seeds else None), targets, *seeds

    def state_dict(self) -> dict[str, Any]:
        """The order/augmentation seed and the train loader's position.

        Lightning also saves the loader's ``state_dict`` in its loop state, but applies it only
        if the loader is built after the checkpoint is restored; a method that reads
        ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` builds it before. The
        data module's own state is restored first, so :meth:`train_dataloader` positions the
        loader itself.
        """
        state: dict[str, Any] = {"seed": self.train_seed}
        if self._train_loader is not None:
            state["train_loader"] = self._train_loader.state_dict()
        fingerprint = self._train_fingerprint()
        if fingerprint is not None:
            state["dataset_fingerprint"] = fingerprint
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the seed and loader position for :meth:`train_dataloader`; check the layout now
        (before Lightning builds the loaders), see :meth:`EpochSampler.load_state_dict`."""
        self._restored_seed = int(state_dict["seed"])
        self._restored_loader = state_dict.get("train_loader")
        self._restored_fingerprint = state_dict.get("dataset_fingerprint")
        self._restored = True
        if self._restored_loader is not None and self.train_dataset is not None:
            self._sampler(self.train_dataset).load_state_dict(
                _saved_sampler_state(self._restored_loader)[1])

    @property
    def train_seed(self) -> int:
        """Seed of the training order and augmentations (see the ``seed`` argument)."""
        if self._restored_seed is not None:
            return self._restored_seed
        if self.seed is not None:
            return self.seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    # ------------------------------------------------------------------ helpers
    def _make_train_loader(self, dataset: Dataset) -> StatefulDataLoader:
        """Resumable loader of ``(epoch, index)`` keys: order and views are pure functions of
        (seed, epoch, index, view), its position goes into the checkpoint (Lightning saves the
        ``state_dict`` of a ``StatefulDataLoader``)."""
        trainer = self.trainer
        sampler = self._sampler(dataset)
        if trainer is not None and trainer.ckpt_path is not None and not self._restored:
            rank_zero_warn(
                f"The checkpoint {trainer.ckpt_path} holds no data-loader position and seed "
                "(written before exact resume existed): the resumed run restarts the epoch at "
                "its beginning, with other samples and augmentations than an uninterrupted run.")
        workers = self.num_workers > 0
        collate = (BatchedViewsCollate(self.device_transform)
                   if self.device_transform is not None and self._views_in_workers() else None)
        self._views_made_in_workers = collate is not None
        loader = StatefulDataLoader(
            SeededDataset(dataset, self.train_seed),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.persistent_workers and workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            worker_init_fn=ignore_stop_signals,
            collate_fn=collate,
        )
        if self._restored_loader is not None:
            self._check_new_layout(sampler, _saved_sampler_state(self._restored_loader)[1])
            self._check_same_files()
            _restore_position(loader, sampler, self._restored_loader)
            self._restored_loader = None
        self._train_loader = loader
        return loader

    def _check_new_layout(self, sampler: EpochSampler, saved: dict[str, Any]) -> None:
        """Refuse another data layout (world size, batch size, dataset) unless Lightning
        resumes at the start of an epoch. A checkpoint written after an epoch's last batch but
        before the epoch ended (a step checkpoint) finishes the sampler's epoch, yet Lightning
        counts that epoch's batches in the new layout and would run the rest of it on the next
        epoch's first samples (half an epoch, unseen)."""
        layout = sampler.state_dict()
        changed = {k: (saved[k], layout[k]) for k in ("num_replicas", "batch_size",
                                                      "dataset_size") if saved[k] != layout[k]}
        trainer = self.trainer
        if not changed or trainer is None:
            return
        if _epoch_unfinished(trainer):
            changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
            raise ValueError(
                f"The checkpoint {trainer.ckpt_path} was written inside epoch {saved['epoch']} "
                f"(by Lightning's loop, after batch {saved['yielded'] // saved['batch_size']}) "
                f"and the data layout changed ({changes}): "
                "the position in the epoch cannot be mapped. Resume with the checkpoint's "
                "world size (devices x nodes), batch_size and dataset, or from a checkpoint "
                "written at the end of an epoch (ModelCheckpoint's save_on_train_epoch_end).")

    def _train_fingerprint(self) -> str | None:
        """:func:`dataset_fingerprint` of the training set (None before it is built)."""
        if self._fingerprint is None and self.train_dataset is not None:
            self._fingerprint = dataset_fingerprint(self.train_dataset)
        return self._fingerprint

    def _check_same_files(self) -> None:
        """Refuse a resume inside an epoch on a training set whose file list (names, sizes)
        differs from the checkpoint's: the position would pick other samples."""
        trainer, saved = self.trainer, self._restored_fingerprint
        if trainer is None or saved is None or not _epoch_unfinished(trainer):
            return
        if saved != self._train_fingerprint():
            raise ValueError(
                f"The checkpoint {trainer.ckpt_path} was written inside an epoch on another "
                f"training set: the file list (names and sizes) of this run's "
                f"{getattr(self.train_dataset, 'root', 'training data')} differs from the "
                "checkpoint's, so its position in the epoch would pick other samples. Resume "
                "on the checkpoint's training data, or from a checkpoint written at the end of "
                "an epoch (ModelCheckpoint's save_on_train_epoch_end).")

    def _views_in_workers(self) -> bool:
        """``"auto"``: the workers unless the trainer runs on an accelerator (also without a
        trainer, so a loader iterated by hand yields views, not uint8 images)."""
        if self.batched_views_on != "auto":
            return self.batched_views_on == "workers"
        trainer = self.trainer
        return trainer is None or trainer.strategy.root_device.type == "cpu"

    def _sampler(self, dataset: Dataset) -> EpochSampler:
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        return EpochSampler(dataset, self.batch_size, self.drop_last, num_replicas=world,
                            rank=rank, seed=self.train_seed)

    def _loader(self, dataset: Dataset, batch_size: int, train: bool) -> DataLoader:
        workers = self.num_workers > 0
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=train,
            drop_last=train and self.drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.persistent_workers and workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            worker_init_fn=ignore_stop_signals,
        )

    def _bank_subset(self, bank: Dataset) -> Dataset:
        size = len(bank)  # type: ignore[arg-type]
        if self.knn_train_subset is None or self.knn_train_subset >= size:
            return bank
        generator = torch.Generator().manual_seed(0)
        indices = torch.randperm(size, generator=generator)[: self.knn_train_subset]
        return Subset(bank, indices.sort().values.tolist())

    def _check_batch_size(self, dataset: Dataset) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        per_device = math.ceil(size / world)
        if self.drop_last and self.batch_size > per_device:
            split = f" split over {world} devices ({per_device} each)" if world > 1 else ""
            raise ValueError(
                f"batch_size={self.batch_size} (per device) is larger than the {size} training "
                f"images{split} of {dataset}, and drop_last=True would drop every batch. "
                "Lower batch_size or set drop_last: false."
            )


def eval_splits(val: Dataset, labeled_train: Dataset | None) -> tuple[Dataset, Dataset]:
    """The (bank, queries) evaluation splits: the labeled train set and ``val``; without one,
    ``val``'s even positions (bank) and odd positions (queries), so both cover every class."""
    if labeled_train is not None:
        return labeled_train, val
    size = len(val)  # type: ignore[arg-type]
    return Subset(val, range(0, size, 2)), Subset(val, range(1, size, 2))


class BatchedViewsCollate:
    """Collate ``([decoded image], target, seed)`` items, then make the views batched on the
    CPU with ``views`` (:class:`DeviceViews` or a subclass; runs in the loader workers)."""

    def __init__(self, views: DeviceViews) -> None:
        self.views = views

    def __call__(self, items: list[Any]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        (images,), targets, seeds = default_collate(items)
        return self.views(images, seeds=seeds), targets, seeds


def _epoch_unfinished(trainer: pl.Trainer) -> bool:
    """Whether Lightning's fit loop resumes inside an epoch: the checkpoint being restored
    counts an epoch started but not processed (read from the checkpoint, since the loops are
    restored after the data module builds its loader)."""
    loaded = restored_checkpoint(trainer)
    progress = loaded.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
    current = progress.get("current", {})
    return int(current.get("ready", 0)) > int(current.get("processed", 0))


def _saved_sampler_state(state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(num_workers, EpochSampler state) of a saved ``StatefulDataLoader`` state (torchdata's
    single-process or multi-worker form)."""
    main = state.get("_snapshot", {}).get("_main_snapshot", state)
    sampler_state = (main.get("_sampler_iter_state") or {}).get("sampler_state")
    if sampler_state is None or state.get("_steps_since_snapshot", 0):
        raise ValueError("The checkpoint's data-loader state holds no EpochSampler position; "
                         "resume from a checkpoint written by this version of ssl_lightning.")
    return int(main.get("_num_workers", 0)), sampler_state


def _restore_position(loader: StatefulDataLoader, sampler: EpochSampler,
                      state: dict[str, Any]) -> None:
    """Load a saved loader state; with another number of workers (torchdata's state only
    loads into the same count) restore just the sampler, which carries the epoch position."""
    workers, sampler_state = _saved_sampler_state(state)
    if workers == loader.num_workers:
        loader.load_state_dict(state)
    else:
        sampler.load_state_dict(sampler_state)
